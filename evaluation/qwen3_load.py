"""Timing Qwen3-Omni requests through a running pipeline, at a given concurrency.

Shared by ``evaluation/pipeline_bench.py`` (tiny preset, CPU) and ``evaluation/qwen3_gpu_check.py``
(full-size architecture, GPU). Per request: time to the first audio chunk (TTFA), time to the last
chunk, the audio it produced and its codec frames (code2wav yields ``1920 * frames - 555``
samples); per level: all of it summarized, and the aggregate codec frames per second of wall time.
RTF = (last chunk - submit) / audio duration: below 1, audio is made faster than it plays.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from evaluation.bench_common import summarize
from pipeline.coordinator import Coordinator
from pipeline.proto import OmniRequest

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
LOST_SAMPLES = 555
_ids = itertools.count()


def frames_of(samples: int) -> int:
    return (samples + LOST_SAMPLES) // SAMPLES_PER_FRAME if samples else 0


@dataclass
class Timing:
    ttfa_s: float | None
    total_s: float
    audio_s: float
    frames: int
    text_tokens: int

    @property
    def rtf(self) -> float | None:
        return self.total_s / self.audio_s if self.audio_s else None


async def timed(coordinator: Coordinator, inputs: dict[str, Any], params: dict[str, Any]) -> Timing:
    request = OmniRequest(f"bench-{next(_ids)}", inputs, params)
    start = time.perf_counter()
    first: float | None = None
    samples = tokens = 0
    async for chunk in coordinator.stream(request):
        audio = chunk.data.get("audio")
        if audio is not None and len(audio):
            first = first if first is not None else time.perf_counter() - start
            samples += len(audio)
        tokens += len(chunk.data.get("token_ids", []))
    return Timing(first, time.perf_counter() - start, samples / SAMPLE_RATE, frames_of(samples), tokens)


async def run_level(
    coordinator: Coordinator,
    make_inputs: Callable[[int], dict[str, Any]],
    params: dict[str, Any],
    concurrency: int,
    rounds: int,
) -> dict[str, Any]:
    """``rounds`` times, ``concurrency`` requests submitted at once; returns the level's summary."""
    timings: list[Timing] = []
    wall = 0.0
    for r in range(rounds):
        start = time.perf_counter()
        timings += await asyncio.gather(
            *(timed(coordinator, make_inputs(r * concurrency + i), params) for i in range(concurrency))
        )
        wall += time.perf_counter() - start
    rtfs = [t.rtf for t in timings if t.rtf is not None]
    return {
        "concurrency": concurrency,
        "requests": len(timings),
        "ttfa_ms": summarize(t.ttfa_s for t in timings if t.ttfa_s is not None),
        "rtf_mean": round(float(np.mean(rtfs)), 3) if rtfs else None,
        "rtf_max": round(float(np.max(rtfs)), 3) if rtfs else None,
        "audio_s_per_request": round(float(np.mean([t.audio_s for t in timings])), 2),
        "frames_per_s": round(sum(t.frames for t in timings) / wall, 1),
        "wall_s": round(wall, 2),
    }
