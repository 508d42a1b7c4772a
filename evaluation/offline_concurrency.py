"""Several callers who finish speaking at the same moment, on the offline model set (issue 28).

    python -m evaluation.offline_concurrency [--rounds 2] [--callers 1 2 4] [--mode process]

For each pipeline setting, ``before`` (the preset as it was: the ``asr`` and ``lm`` stages one
request at a time, ``tts`` with ``max_batch: 4``, the LM's decoder not paced) and ``preset``
(configs/offline.yaml as it is), the script starts the offline pipeline, warms it up, then submits
N different espeak-ng questions at once (``asyncio`` gather, each as the session submits a turn:
``offline_bench.ask``), ``--rounds`` times per N. Per request, from submit: the transcript, the
first answer text (LM first token) and the first agent audio; per setting and N, their p50 and max
over every request of every round. (``before`` runs today's runner code: with one request at a
time it behaves as before, but the ``tts`` runner now picks the most urgent answer either way.)
Prints a table, writes evaluation/results/offline_concurrency.{json,png}. Runs in a loopback-only
network namespace (``unshare --net``), as the tests do.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import matplotlib

from evaluation.bench_common import (
    ROOT,
    format_table,
    machine,
    run_in_loopback_namespace,
    save_figure,
    save_results,
    summarize,
)
from evaluation.offline_bench import QUESTIONS, Turn, ask
from pipeline.config import PipelineConfig, parse_pipeline_config, read_yaml
from pipeline.models.offline.sources import lm_source, prepare_lm
from pipeline.runner import start_pipeline

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PHASES = ("transcript", "first_text", "first_audio")
# What issue 28 changed in the preset: its values before.
BEFORE = {"asr": {"max_batch": 1}, "lm": {"max_batch": 1}, "tts": {"max_batch": 4}}
BEFORE_LM_OPTIONS = {"pace_tokens_per_s": 0}


def settings() -> dict[str, PipelineConfig]:
    """The preset as it was before issue 28, and as it is."""
    raw = read_yaml(ROOT / "configs" / "offline.yaml")["pipeline"]
    before = [{**stage, **BEFORE.get(stage["name"], {})} for stage in raw["stages"]]
    for stage in before:
        if stage["name"] == "lm":
            stage["options"] = {**stage.get("options", {}), **BEFORE_LM_OPTIONS}
    return {"before": parse_pipeline_config({**raw, "stages": before}),
            "preset": parse_pipeline_config(raw)}


async def measure(config: PipelineConfig, mode: str, callers: list[int],
                  rounds: int) -> dict[str, Any]:
    """One pipeline: per N, the turns of every round of N questions submitted together."""
    started = time.perf_counter()
    coordinator = await start_pipeline(config, mode=mode)
    start_s = time.perf_counter() - started
    try:
        await ask(coordinator, "warmup", "Hello there.")
        out: dict[str, Any] = {"pipeline_start_s": round(start_s, 2)}
        for n in callers:
            turns: list[Turn] = []
            for r in range(rounds):
                # Different questions each round and caller: no two requests are the same text.
                asked = [QUESTIONS[(r * n + i) % len(QUESTIONS)] for i in range(n)]
                turns += await asyncio.gather(*(
                    ask(coordinator, f"n{n}-r{r}-{i}", q) for i, q in enumerate(asked)
                ))
            out[str(n)] = {
                "ms": {p: summarize(t.times[p] for t in turns) for p in PHASES},
                "turns": [{"question": t.question, "transcript": t.transcript, "answer": t.text,
                           "ms": {k: round(v * 1000) for k, v in t.times.items()}}
                          for t in turns],
            }
        return out
    finally:
        await coordinator.close()


async def run(mode: str, callers: list[int], rounds: int) -> dict[str, Any]:
    await asyncio.to_thread(prepare_lm, lm_source("packaged"))
    results: dict[str, Any] = {"mode": mode, "rounds": rounds, "machine_start": machine()}
    for name, config in settings().items():
        results[name] = await measure(config, mode, callers, rounds)
    results["machine_end"] = machine()
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    names = [n for n in ("before", "preset") if n in results]
    callers = [k for k in results[names[0]] if k.isdigit()]
    fig, axes = plt.subplots(1, len(PHASES), figsize=(13, 4), sharey=True)
    width = 0.8 / len(names)
    for ax, phase in zip(axes, PHASES, strict=True):
        for j, name in enumerate(names):
            xs = [i + j * width for i in range(len(callers))]
            p50 = [results[name][n]["ms"][phase]["p50"] for n in callers]
            worst = [results[name][n]["ms"][phase]["max"] for n in callers]
            ax.bar(xs, p50, width, label=f"{name} p50", color=f"C{j}")
            ax.scatter(xs, worst, marker="_", s=300, color="k",
                       label="max" if j == 0 and phase == PHASES[0] else None)
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(callers))], callers)
        ax.set_xlabel("callers who finish together")
        ax.set_title(phase.replace("_", " ") + " after submit")
    axes[0].set_ylabel("ms")
    axes[-1].axhline(1000, color="r", linestyle="--", label="budget: 4 callers ≤ 1 s (on the wire)")
    for ax in (axes[0], axes[-1]):
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"offline preset, {results['mode']} mode, {results['rounds']} rounds, "
                 f"load {results['machine_start']['load_1min']}-{results['machine_end']['load_1min']}")
    save_figure(fig, path, dpi=100)


def main() -> None:
    run_in_loopback_namespace("evaluation.offline_concurrency")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["process", "inproc"], default="process")
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = asyncio.run(run(args.mode, args.callers, args.rounds))
    rows = [
        [name, n, phase, results[name][n]["ms"][phase]["p50"], results[name][n]["ms"][phase]["max"]]
        for name in ("before", "preset")
        for n in map(str, args.callers)
        for phase in PHASES
    ]
    print(format_table(["setting", "callers", "from submit to", "p50 ms", "max ms"], rows))
    print(f"load at start / end: {results['machine_start']} / {results['machine_end']}")
    save_results("offline_concurrency", results, plot)


if __name__ == "__main__":
    main()
