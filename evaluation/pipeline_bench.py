"""Qwen3-Omni on the pipeline vs transformers' own generate, same tiny weights, in one run.

    python -m evaluation.pipeline_bench [--rounds 2] [--reference-requests 8]

The tiny preset (configs/qwen3_omni_tiny.yaml: the real architecture at toy size, random weights,
CPU, stage processes) serves espeak-ng questions at 1, 4 and 8 concurrent requests: time to the
first audio chunk (TTFA), real-time factor, and aggregate codec frames per second. The reference
is ``Qwen3OmniMoeForConditionalGeneration.generate`` (greedy talker, the preset's caps) on the same
requests one after another in this process: its first audio is its whole answer, and its frames/s
is what a server calling ``generate`` per request sustains. Ratios compare the two.

The tiny model is overhead-bound (Python and framework costs dominate its ~ms forwards): the
numbers say how the pipeline's streaming and batching behave, not what a GPU does with the real
model (see evaluation/gpu_check.sh for that). Prints a table and writes
evaluation/results/pipeline_bench.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import matplotlib
import numpy as np
import torch
from transformers.utils import logging as hf_logging

from evaluation.bench_common import (
    ROOT,
    format_table,
    machine,
    run_in_loopback_namespace,
    save_figure,
    save_results,
)
from evaluation.qwen3_load import frames_of, run_level, timed
from harness.speech import speech
from pipeline.config import PipelineConfig, parse_pipeline_config, read_yaml
from pipeline.models import StageContext
from pipeline.models.qwen3_omni import loading
from pipeline.models.qwen3_omni.preprocess import Preprocessor
from pipeline.models.qwen3_omni.reference import answer_length, generate_capped, load_reference
from pipeline.models.qwen3_omni.talker import TalkerOptions, step_cap
from pipeline.proto import StagePayload
from pipeline.runner import start_pipeline
from pipeline.scheduling.base import BatchItem

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

LEVELS = (1, 4, 8)
QUESTIONS = [
    "what is the weather like today",
    "tell me a short story about a cat",
    "how far away is the moon",
    "can you recommend a good book",
    "what time is it in tokyo",
    "how do I make a cup of tea",
    "why is the sky blue",
    "what should I cook for dinner",
]


def inputs(i: int) -> dict[str, Any]:
    audio = speech(QUESTIONS[i % len(QUESTIONS)], 16000)
    return {"messages": [{"role": "user", "text": None, "audio": audio, "sample_rate": 16000}]}


async def pipeline_levels(config: PipelineConfig, rounds: int) -> dict[str, Any]:
    started = time.perf_counter()
    coordinator = await start_pipeline(config, mode="process", ready_timeout=300)
    startup = time.perf_counter() - started
    try:
        await timed(coordinator, inputs(0), {})  # warm-up: first-call costs are not the pipeline's
        levels = [await run_level(coordinator, inputs, {}, c, rounds) for c in LEVELS]
    finally:
        await coordinator.close()
    return {"startup_s": round(startup, 1), "levels": levels}


def reference_run(config: PipelineConfig, n: int) -> dict[str, Any]:
    """``generate`` of n requests one after another (caps as the preset's; timed: generate only)."""
    # One intra-op thread, as each stage process of the preset has: more only fight over 2 cores.
    torch.set_num_threads(1)
    source = loading.resolve(config.model_args)
    model = load_reference(source)
    pre = Preprocessor(StageContext(config.stage("preprocessing"), config.model_args))
    talker = config.stage("talker")
    opts = TalkerOptions(**talker.options)
    thinker_cap = config.stage("thinker").max_new_tokens
    latencies, frames = [], 0
    for i in range(n + 1):  # the first is a warm-up
        item = BatchItem(StagePayload(f"ref-{i}", inputs(i), {}), final=True)
        prepared = pre.run([item])[0]
        answer = answer_length(model, prepared, thinker_cap)  # the pipeline learns it as it goes
        talker_cap = min(talker.max_new_tokens, step_cap(answer, opts))
        start = time.perf_counter()
        out = generate_capped(model, prepared, thinker_cap, talker_cap)
        if i:
            latencies.append(time.perf_counter() - start)
            frames += frames_of(len(out.waveform))
    return {
        "requests": n,
        "latency_ms_mean": round(1000 * float(np.mean(latencies)), 1),
        "frames_per_s": round(frames / sum(latencies), 1),
        "torch_threads": torch.get_num_threads(),
    }


def add_ratios(results: dict[str, Any]) -> None:
    ref = results["reference"]
    for level in results["pipeline"]["levels"]:
        level["frames_per_s_vs_reference"] = round(level["frames_per_s"] / ref["frames_per_s"], 2)
        level["ttfa_p50_vs_reference_latency"] = round(level["ttfa_ms"]["p50"] / ref["latency_ms_mean"], 3)


def table(results: dict[str, Any]) -> str:
    ref = results["reference"]
    rows = [
        [f"pipeline x{lv['concurrency']}", lv["requests"], lv["ttfa_ms"]["p50"], lv["ttfa_ms"]["p99"],
         lv["rtf_mean"], lv["frames_per_s"], lv["frames_per_s_vs_reference"],
         lv["ttfa_p50_vs_reference_latency"]]
        for lv in results["pipeline"]["levels"]
    ]
    rows.append(["generate, sequential", ref["requests"], ref["latency_ms_mean"], None, None,
                 ref["frames_per_s"], 1.0, 1.0])
    return format_table(
        ["run", "requests", "TTFA p50 ms", "TTFA p99 ms", "RTF mean", "frames/s",
         "frames/s ratio", "TTFA / generate latency"],
        rows,
    )


def plot(results: dict[str, Any], path: os.PathLike) -> None:
    levels = results["pipeline"]["levels"]
    ref = results["reference"]
    x = [str(lv["concurrency"]) for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(x, [lv["frames_per_s"] for lv in levels], color="tab:blue", label="pipeline")
    left.axhline(ref["frames_per_s"], color="tab:red", linestyle="--", label="generate, sequential")
    left.set(xlabel="concurrent requests", ylabel="codec frames / s (aggregate)", title="throughput")
    left.legend()
    right.bar(x, [lv["ttfa_ms"]["p50"] for lv in levels], color="tab:green", label="pipeline TTFA p50")
    right.axhline(ref["latency_ms_mean"], color="tab:red", linestyle="--", label="generate latency")
    right.set(xlabel="concurrent requests", ylabel="ms", title="time to first audio")
    right.legend()
    fig.suptitle("tiny Qwen3-Omni (random weights, CPU): pipeline vs generate")
    save_figure(fig, path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds per concurrency level")
    parser.add_argument("--reference-requests", type=int, default=8)
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.pipeline_bench")
    hf_logging.set_verbosity_error()  # every stage reports the checkpoint keys it does not load
    config = parse_pipeline_config(read_yaml(ROOT / "configs" / "qwen3_omni_tiny.yaml")["pipeline"])
    results: dict[str, Any] = {"preset": "qwen3_omni_tiny"}
    results["pipeline"] = asyncio.run(pipeline_levels(config, args.rounds))
    results["reference"] = reference_run(config, args.reference_requests)
    add_ratios(results)
    results["machine"] = machine()
    print(table(results))
    print(f"\npipeline startup {results['pipeline']['startup_s']} s; machine {results['machine']}")
    save_results("pipeline_bench", results, plot)


if __name__ == "__main__":
    main()
