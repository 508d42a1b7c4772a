"""A real Session fed in real time, 20 ms of 16 kHz audio every 20 ms, as a transport feeds it:
for the benchmarks that drive a Session directly (evaluation/speculation_bench.py,
evaluation/backchannel_eval.py). Holds nothing between calls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np

from duplex.session.session import Session
from duplex.turns.vad import SAMPLE_RATE

STEP = SAMPLE_RATE // 50  # 20 ms


async def speak(session: Session, audio: np.ndarray) -> None:
    """``audio`` (16 kHz) into the session in real time; a last partial 20 ms is left out."""
    for start in range(0, len(audio) - STEP + 1, STEP):
        session.on_audio(audio[start : start + STEP])
        await asyncio.sleep(0.02)


async def silence_until(session: Session, condition: Callable[[], object], limit_s: float) -> None:
    """Silence into the session in real time until ``condition()`` holds or ``limit_s`` passed."""
    quiet, began = np.zeros(STEP, np.float32), time.perf_counter()
    while not condition() and time.perf_counter() - began < limit_s:
        session.on_audio(quiet)
        await asyncio.sleep(0.02)
