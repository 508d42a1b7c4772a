"""Full-size Qwen3-Omni-30B-A3B on one GPU, random weights, nothing downloaded: TTFA and RTF.

Run through ``evaluation/gpu_check.sh`` (which bounds it to 8 minutes). It writes a checkpoint
directory without weights (the real config, tokenizer ids and feature extractor;
``pipeline.models.qwen3_omni.synthetic``), serves it with the real preset (configs/qwen3_omni.yaml:
its stages, processes and placement; bfloat16) with ``random_weights: true`` so every stage draws
its weights on the GPU, then sends 1, 4 and 8 concurrent requests of 3 s of audio. Random weights
never say EOS: answers run to a bounded cap (``--thinker-tokens`` text tokens, 4 codec frames per
token), which keeps the check short. The numbers are the architecture's speed through this
pipeline, not the trained model's answers.

    python -m evaluation.qwen3_gpu_check [--size full|tiny] [--device cuda:0|cpu] [--dtype bfloat16]

``--size tiny --device cpu --dtype float32`` rehearses the whole path on a CPU in about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.utils import logging as hf_logging

from evaluation.bench_common import ROOT, format_table, write_json
from evaluation.qwen3_load import run_level, timed
from pipeline.config import PipelineConfig, parse_pipeline_config, read_yaml
from pipeline.models.qwen3_omni import tiny
from pipeline.models.qwen3_omni.synthetic import write_random_checkpoint
from pipeline.runner import start_pipeline

LEVELS = (1, 4, 8)
AUDIO_S = 3.0


def checkpoint(size: str, directory: Path) -> Path:
    if size == "full":
        return write_random_checkpoint(directory)
    return write_random_checkpoint(directory, tiny.tiny_config_dict(), tiny.TOKEN_IDS)


def check_config(path: Path, device: str, dtype: str) -> PipelineConfig:
    """The real preset, its weights drawn at load, its GPU stages on ``device``, answers bounded."""
    data = read_yaml(ROOT / "configs" / "qwen3_omni.yaml")["pipeline"]
    stages = []
    for stage in data["stages"]:
        stage = dict(stage)
        if stage.get("device", "cpu") != "cpu":
            stage["device"] = device
        if stage["name"] == "talker":
            stage["options"] = {**stage.get("options", {}), "frames_per_token": 4, "extra_frames": 0}
        stages.append(stage)
    model_args = {"checkpoint": str(path), "dtype": dtype, "random_weights": True}
    return parse_pipeline_config({**data, "model_args": model_args, "stages": stages})


def audio_inputs(i: int) -> dict[str, Any]:
    """3 s of a chirp in noise (content is irrelevant to random weights; only the length counts)."""
    rng = np.random.default_rng(i)
    t = np.arange(int(16000 * AUDIO_S)) / 16000
    audio = 0.3 * np.sin(2 * np.pi * (200 + 100 * i + 300 * t) * t) + 0.02 * rng.standard_normal(t.size)
    return {"messages": [{"role": "user", "text": None, "audio": audio.astype(np.float32), "sample_rate": 16000}]}


async def measure(config: PipelineConfig, params: dict[str, Any], rounds: int) -> dict[str, Any]:
    started = time.perf_counter()
    coordinator = await start_pipeline(config, mode="process", ready_timeout=420)
    startup = time.perf_counter() - started
    try:
        warm = await timed(coordinator, audio_inputs(99), params)  # kernels, allocator, caches
        levels = [await run_level(coordinator, audio_inputs, params, c, rounds) for c in LEVELS]
    finally:
        await coordinator.close()
    return {"startup_s": round(startup, 1), "warmup_total_s": round(warm.total_s, 2), "levels": levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["full", "tiny"], default="full")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--thinker-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    params = {"max_output_tokens": args.thinker_tokens}
    with tempfile.TemporaryDirectory(prefix="qwen3-omni-random-") as tmp:
        config = check_config(checkpoint(args.size, Path(tmp)), args.device, args.dtype)
        results = asyncio.run(measure(config, params, args.rounds))
    results.update({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "size": args.size,
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device,
        "dtype": args.dtype,
        "thinker_tokens": args.thinker_tokens,
        "torch": torch.__version__,
    })
    rows = [
        [lv["concurrency"], lv["requests"], lv["ttfa_ms"]["p50"], lv["ttfa_ms"]["max"], lv["rtf_mean"],
         lv["rtf_max"], lv["audio_s_per_request"], lv["frames_per_s"]]
        for lv in results["levels"]
    ]
    print(format_table(
        ["concurrency", "requests", "TTFA p50 ms", "TTFA max ms", "RTF mean", "RTF max",
         "audio s/request", "frames/s (all)"],
        rows,
    ))
    print(f"\n{results['size']} Qwen3-Omni, random {args.dtype} weights, on {results['device']}; "
          f"startup {results['startup_s']} s; {results['date']}")
    print(f"wrote {write_json(f'gpu_check_{args.size}', results)}")


if __name__ == "__main__":
    main()
