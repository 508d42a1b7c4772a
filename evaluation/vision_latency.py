"""What images cost on the tiny Qwen3-Omni preset (CPU): time to first audio with 0, 1 and 4
images in the turn, and images a second through the image encoder.

- Time to first audio: the tiny preset served by ``start_pipeline`` (stage processes, as the
  server runs it; ``--mode inproc`` for one process), one request at a time: a user turn of 2 s of
  speech with 0, 1 or 4 pictures (128 x 128: 16 vision tokens each, the tiny processor's most),
  the three kinds interleaved run by run. Measured from the request's submission to its first
  code2wav chunk (and to its first text).
- The image encoder alone (its runner, in this process, one torch thread): images a second for
  batches of 1, 4 and 16 pictures (one call each), preprocessing's patching excluded.

Prints a table and writes evaluation/results/vision_latency.json.

    python -m evaluation.vision_latency [--runs 20] [--mode process|inproc] [--images 0 1 4]
        [--label NAME]

``--images 0`` also runs on a preset without an image encoder (the six-stage graph of an older
checkout), for the audio-only comparison; ``--label`` names the result file
(``vision_latency_NAME.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from evaluation.bench_common import format_table, machine, summarize, write_json
from harness.speech import speech
from pipeline.config import parse_pipeline_config, read_yaml
from pipeline.models import StageContext, get_model
from pipeline.proto import OmniRequest, StagePayload, new_request_id
from pipeline.runner import start_pipeline
from pipeline.scheduling.base import BatchItem

ROOT = Path(__file__).resolve().parent.parent
IMAGE_COUNTS = (0, 1, 4)
SIDE = 128


def picture(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).random((SIDE, SIDE, 3)) * 255).astype(np.uint8)


def turn(images: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "user", "audio": speech("what do you see in front of you"),
                               "sample_rate": 16000}
    if images:
        message["images"] = [picture(k) for k in range(images)]
    return {"messages": [message]}


async def first_outputs(coordinator: Any, images: int) -> tuple[float, float]:
    """Seconds from submission to the first text and to the first audio of one request."""
    request = OmniRequest(new_request_id(), turn(images), {})
    start = time.perf_counter()
    text = audio = None
    async for chunk in coordinator.stream(request):
        now = time.perf_counter() - start
        if text is None and chunk.data.get("text"):
            text = now
        if audio is None and "audio" in chunk.data:
            audio = now
    assert text is not None and audio is not None, "an answer without text or audio"
    return text, audio


async def latency(runs: int, mode: str, counts: list[int]) -> dict[str, Any]:
    config = parse_pipeline_config(read_yaml(ROOT / "configs" / "qwen3_omni_tiny.yaml")["pipeline"])
    coordinator = await start_pipeline(config, mode=mode, ready_timeout=300)
    got: dict[int, list[tuple[float, float]]] = {n: [] for n in counts}
    try:
        for n in counts:  # warm-up: first calls load kernels and caches
            await first_outputs(coordinator, n)
        for _ in range(runs):
            for n in counts:
                got[n].append(await first_outputs(coordinator, n))
    finally:
        await coordinator.close()
    return {
        str(n): {"first_text_ms": summarize(t for t, _ in got[n]), "first_audio_ms": summarize(a for _, a in got[n])}
        for n in counts
    }


def encoder_rate(repeats: int = 20) -> dict[str, Any] | None:
    config = parse_pipeline_config(read_yaml(ROOT / "configs" / "qwen3_omni_tiny.yaml")["pipeline"])
    if "image_encoder" not in [s.name for s in config.stages]:
        return None
    spec = get_model(config.model)
    pre = spec.factories["preprocessing"](StageContext(config.stage("preprocessing"), config.model_args))
    encoder = spec.factories["image_encoder"](StageContext(config.stage("image_encoder"), config.model_args))
    out: dict[str, Any] = {}
    for batch in (1, 4, 16):
        items = []
        for k in range(batch):
            inputs = {"messages": [{"role": "user", "images": [picture(k)], "text": "?"}]}
            items.append(BatchItem(StagePayload(f"r{k}", pre.run([BatchItem(StagePayload(f"r{k}", inputs), True)])[0]), True))
        encoder.run(items)  # warm-up
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            encoder.run(items)
            seconds.append(time.perf_counter() - start)
        out[str(batch)] = {"call_ms": summarize(seconds), "images_per_s": round(batch / float(np.median(seconds)), 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--mode", choices=("process", "inproc"), default="process")
    parser.add_argument("--images", type=int, nargs="+", default=list(IMAGE_COUNTS))
    parser.add_argument("--label", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {"machine": machine(), "mode": args.mode, "runs": args.runs, "image_side": SIDE,
               "time_to_first": asyncio.run(latency(args.runs, args.mode, args.images)),
               "image_encoder": encoder_rate()}
    rows = [(n, r["first_text_ms"]["p50"], r["first_audio_ms"]["p50"], r["first_audio_ms"]["p99"])
            for n, r in results["time_to_first"].items()]
    print(format_table(["images", "first text p50 ms", "first audio p50 ms", "first audio p99 ms"], rows))
    if results["image_encoder"] is not None:
        rows = [(b, r["call_ms"]["p50"], r["images_per_s"]) for b, r in results["image_encoder"].items()]
        print(format_table(["batch", "encoder call p50 ms", "images/s"], rows))
    print(write_json("vision_latency" + (f"_{args.label}" if args.label else ""), results))


if __name__ == "__main__":
    main()
