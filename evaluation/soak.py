"""``python -m evaluation.soak [--minutes 10]``: a bounded soak. Four Realtime WebSocket sessions on
the ``toy`` preset talk for ``--minutes``: each asks in speech, lets most answers play to their end
and asks again after a pause of 0.5–2 s, and interrupts about a third of them at a random moment
(speech over the answer or ``response.cancel``; evaluation/speaking_client.py).

The same frame as evaluation/abort_storm.py (warm-up, baseline, load, idle) and the same samples
each second (evaluation/resource_sampler.py). Reported: turns answered, barge-ins, errors, RSS
growth (baseline to end, and its slope over the load's second half, where a leak would show
without the warm-up's one-time growth), fd and thread counts at start and end, shm segments and
live state. Writes evaluation/results/soak.json and .png. Runs itself in a loopback-only namespace.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from evaluation.abort_storm import arguments, load_results, measured_load, report
from evaluation.bench_common import run_in_loopback_namespace, save_results
from evaluation.resource_sampler import plot_samples

BARGE_IN_SHARE = 0.3
PAUSE_S = (0.5, 2.0)


def until(minutes: float) -> Callable[[], Callable[[], bool]]:
    """A ``go_on`` maker for ``measured_load``: true until ``minutes`` after the load starts."""
    def make() -> Callable[[], bool]:
        deadline = time.monotonic() + minutes * 60
        return lambda: time.monotonic() < deadline

    return make


def rss_slope_mb_per_min(samples: list[dict[str, Any]], span: tuple[float, float]) -> float | None:
    """RSS trend (server + stages) over the second half of the load, by least squares."""
    middle = (span[0] + span[1]) / 2
    half = [(s["t"], s["rss_mb"]) for s in samples if middle <= s["t"] <= span[1]]
    if len(half) < 2:
        return None
    t, rss = np.array(half).T
    return round(float(np.polyfit(t / 60, rss, 1)[0]), 3)


def plot(results: dict[str, Any], path: Path) -> None:
    plot_samples(results["samples"], path,
                 f"soak: {results['minutes']} min, {results['sessions']} sessions, "
                 f"{results['answered']} answered, {results['barge_ins_done']} barge-ins",
                 [(*results["load_span_s"], "soak")])


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.soak")
    run = asyncio.run(measured_load(args.sessions, args.seed, until(args.minutes),
                                    BARGE_IN_SHARE, PAUSE_S))
    results = {"minutes": args.minutes, "sessions": args.sessions, "seed": args.seed,
               **load_results(run)}
    resources = results["resources"]
    results["rss_growth_mb"] = resources["rss_mb"]["change"]
    results["rss_slope_second_half_mb_per_min"] = rss_slope_mb_per_min(results["samples"], run.span)
    report(results)
    print(f"RSS growth {results['rss_growth_mb']} MB over the run; second half of the load: "
          f"{results['rss_slope_second_half_mb_per_min']} MB/min")
    save_results("soak", results, plot)


if __name__ == "__main__":
    main()
