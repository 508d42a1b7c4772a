"""``python -m evaluation.abort_storm``: 1,000 barge-ins at random moments across 4 concurrent
Realtime WebSocket sessions on the ``toy`` preset, and whether the server is back at its baseline
afterwards.

Each session asks a question in speech, waits for the answer's first audio, waits a random
0–1 s more and interrupts: by speaking over it (server_vad barge-in) or with ``response.cancel``
followed by speech (evaluation/speaking_client.py). The interruption is the next question, so the
next answer follows and is interrupted in turn, until the 1,000 barge-ins are spent. Meanwhile
evaluation/resource_sampler.py samples the server each second: RSS, fds, threads, /dev/shm
segments, ``pipeline_stage_live_requests``.

Phases (``measured_load``, which evaluation/soak.py runs with its own load): a warm-up of
WARM_UP barge-ins, so that what grows on first use is in the baseline; the baseline; the load;
then idle. The server must end with no live request, no shm segment, no session, and the
processes, fds and threads of its baseline.

Writes evaluation/results/abort_storm.json and .png. Runs itself in a loopback-only namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from evaluation.bench_common import (
    format_table,
    machine,
    run_in_loopback_namespace,
    save_results,
    summarize,
)
from evaluation.duplex_calls import scrape_metrics
from evaluation.resource_sampler import (
    ResourceSampler,
    Sample,
    as_json,
    baseline_table,
    plot_samples,
    watch,
)
from evaluation.speaking_client import (
    BENIGN_ERRORS,
    LOAD_STAGES,
    SessionLog,
    error_counts,
    run_sessions,
)
from harness.server import run_server, write_preset

ABORTS = "pipeline_abort_clear_seconds_count"  # pipeline requests aborted (and cleared) so far
# Barge-ins before the baseline: pools that grow on demand (the event loop's default executor,
# ZMQ's) reach their working size in the warm-up, so that what the load adds shows as growth.
WARM_UP = 40


class Budget:
    """How many barge-ins are left to start, shared by the sessions (one event loop: no lock)."""

    def __init__(self, count: int) -> None:
        self.left = count

    def take(self) -> bool:
        self.left -= 1
        return self.left >= 0


@dataclass
class LoadRun:
    """A measured load: the sessions' logs, the samples from the baseline on, the load's span."""

    logs: list[SessionLog]
    warm_up: list[SessionLog]
    samples: list[Sample]
    span: tuple[float, float]
    server_aborts: float  # pipeline aborts during the load, as the server counted them


async def measured_load(sessions: int, seed: int, go_on: Callable[[], Callable[[], bool]],
                        barge_in_share: float, pause_s: tuple[float, float] = (0.0, 0.0)
                        ) -> LoadRun:
    """A fresh toy server (LOAD_STAGES): warm-up, baseline, ``sessions`` users conversing while
    ``go_on()`` (made when the load starts) says so, then sampled until idle."""
    with tempfile.TemporaryDirectory(prefix="duplex-load-") as tmp:
        preset = write_preset(Path(tmp) / "preset.yaml", stages=LOAD_STAGES)
        with run_server(preset, tmp=Path(tmp)) as server:
            sampler = ResourceSampler(server)
            warm = await run_sessions(server, sessions, seed, Budget(WARM_UP).take, 1.0)
            baseline = await sampler.until_idle()
            aborts_before = (await scrape_metrics(server.url))[ABORTS]
            logs, span = await watch(sampler, run_sessions(server, sessions, seed + sessions,
                                                           go_on(), barge_in_share, pause_s))
            aborts = (await scrape_metrics(server.url))[ABORTS] - aborts_before
    samples = [s for s in sampler.samples if s.t >= baseline.t]
    return LoadRun(logs, warm, samples, span, aborts)


def load_results(run: LoadRun) -> dict[str, Any]:
    """What both benchmarks report of a load: its barge-ins, turns, errors and resources."""
    done = [b for log in run.logs for b in log.barge_ins]
    return {
        "machine": machine(), "preset": {"base": "toy", "stages": LOAD_STAGES},
        "warm_up_failures": [log.failure for log in run.warm_up if log.failure],
        "barge_ins_done": len(done),
        "by_method": dict(Counter(b.method for b in done)),
        "response_status": dict(Counter(b.status for b in done)),
        "server_aborts": run.server_aborts,
        "answered": sum(log.answered for log in run.logs),
        "without_audio": sum(log.without_audio for log in run.logs),
        "session_failures": [log.failure for log in run.logs if log.failure],
        "errors": error_counts(run.logs),
        "stop_ms": summarize(b.stop_s for b in done),
        "load_span_s": run.span,
        "barge_ins": [asdict(b) for b in done],
        **baseline_table(run.samples),
        "samples": as_json(run.samples),
    }


def report(results: dict[str, Any]) -> None:
    print(f"barge-ins done: {results['barge_ins_done']} {results['by_method']}; interrupted "
          f"responses {results['response_status']}; "
          f"pipeline aborts {results['server_aborts']:.0f}; "
          f"answered {results['answered']}; without audio {results['without_audio']}")
    print(f"interruption → response.done (ms): {results['stop_ms']}")
    unexpected = {k: v for k, v in results["errors"].items() if k not in BENIGN_ERRORS}
    print(f"errors: {results['errors']} (unexpected: {unexpected}); "
          f"session failures: {results['session_failures']}")
    print(format_table(*results["table"]))
    print(f"live requests by stage at the end: {results['live_by_stage_end']}")
    print(f"back at baseline: {results['back_at_baseline']}")


def plot(results: dict[str, Any], path: Path) -> None:
    plot_samples(results["samples"], path,
                 f"abort storm: {results['barge_ins_done']} barge-ins, "
                 f"{results['sessions']} sessions",
                 [(*results["load_span_s"], "storm")])


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options of both load benchmarks (each adds its own); ``doc``'s first paragraph is the
    description."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--barge-ins", type=int, default=1000)
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.abort_storm")
    run = asyncio.run(measured_load(args.sessions, args.seed,
                                    lambda: Budget(args.barge_ins).take, barge_in_share=1.0))
    results = {"sessions": args.sessions, "barge_ins_asked": args.barge_ins, "seed": args.seed,
               **load_results(run)}
    report(results)
    save_results("abort_storm", results, plot)


if __name__ == "__main__":
    main()
