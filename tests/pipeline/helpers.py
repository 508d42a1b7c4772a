"""Helpers for the pipeline tests: configs, requests, the toy model's predictable answers, and
waiting (with a deadline) until every stage holds nothing.

The toy model answers a turn with ``answer_token(seed, k)`` for k = 0..n-1 (the text terminal says
``"w{token} "`` per token), and voices each token as ``frames_per_token`` codec frames whose first
code is ``(token + frame index) % 2048``; the vocoder turns a frame into 1920 samples of a tone with
carried phase. ``expected_*`` rebuild that answer from the toy package's own functions, so a test can
compare what the pipeline streamed with what the runners produce for the whole answer at once.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prometheus_client import REGISTRY

from pipeline.config import PipelineConfig, parse_pipeline_config, read_yaml
from pipeline.coordinator import Coordinator
from pipeline.models import StageContext
from pipeline.models.toy.runners import ToyVocoder, answer_token, input_seed
from pipeline.proto import OmniRequest, OutputChunk, StagePayload, StageStats
from pipeline.runner import start_pipeline
from pipeline.transport.shm import leftover_segments

REPO = Path(__file__).resolve().parents[2]
MODES = ("inproc", "process")
_ids = itertools.count()


def toy_config(options: dict[str, dict[str, Any]] | None = None, **pipeline: Any) -> PipelineConfig:
    """configs/toy.yaml (thinker -> decode (text) and talker -> code2wav (audio)), with stage
    ``options`` updated per stage name and top-level fields overridden by ``pipeline``."""
    data = read_yaml(REPO / "configs" / "toy.yaml")["pipeline"]
    stages = [
        {**s, "options": {**s.get("options", {}), **(options or {}).get(s["name"], {})}}
        for s in data["stages"]
    ]
    return parse_pipeline_config({**data, "stages": stages, **pipeline})


def fan_in_config() -> PipelineConfig:
    """split -> (a, b) -> join -> tail, where ``a`` relays at once and ``b`` is a toy thinker that
    takes a few steps (or runs until aborted with ``toy_never_stop``): ``join`` must wait for it.
    Two processes, so that every edge crosses between them in process mode."""
    relay = {"runner": "relay", "scheduler": "simple"}
    return parse_pipeline_config(
        {
            "model": "toy",
            "entry": "split",
            "stages": [
                {"name": "split", **relay, "next": ["a", "b"], "process": "one"},
                {"name": "a", **relay, "next": ["join"], "process": "two"},
                {
                    "name": "b",
                    "runner": "thinker",
                    "scheduler": "ar",
                    "max_new_tokens": 100000,
                    "next": ["join"],
                    "process": "two",
                    "options": {"answer_tokens": 5, "hidden_size": 4, "step_delay_s": 0.001},
                },
                {
                    "name": "join",
                    **relay,
                    "wait_for": ["a", "b"],
                    "merge": "join",
                    "next": ["tail"],
                    "process": "one",
                },
                {"name": "tail", **relay, "terminal": True, "process": "two"},
            ],
        }
    )


def turn(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "text": text, "audio": None, "sample_rate": None}]}


def audio_turn(samples: int) -> dict[str, Any]:
    """A user turn of ``samples`` samples of noise (large enough to ride shared memory)."""
    audio = np.random.default_rng(samples).standard_normal(samples).astype(np.float32)
    return {"messages": [{"role": "user", "text": None, "audio": audio, "sample_rate": 16000}]}


def make_request(inputs: dict[str, Any] | None = None, **params: Any) -> OmniRequest:
    return OmniRequest(f"req-{next(_ids)}", inputs or turn("hello"), params)


@dataclass
class Outcome:
    """Everything a stream yielded, by terminal stage."""

    chunks: list[OutputChunk] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c.data.get("text", "") for c in self.chunks)

    @property
    def audio(self) -> np.ndarray:
        pieces = [c.data["audio"] for c in self.chunks if "audio" in c.data]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)

    @property
    def finals(self) -> list[str]:
        return [c.stage for c in self.chunks if c.final]


async def collect(coordinator: Coordinator, request: OmniRequest, timeout: float = 30.0) -> Outcome:
    """Stream ``request`` to its end (completion or abort); raises what the stream raises."""
    outcome = Outcome()
    async with asyncio.timeout(timeout):
        async for chunk in coordinator.stream(request):
            assert chunk.request_id == request.request_id
            outcome.chunks.append(chunk)
    return outcome


def answer_tokens(inputs: dict[str, Any], n: int) -> list[int]:
    seed = input_seed(inputs)
    return [answer_token(seed, k) for k in range(n)]


def expected_text(inputs: dict[str, Any], n: int) -> str:
    return "".join(f"w{token} " for token in answer_tokens(inputs, n))


def expected_audio(config: PipelineConfig, inputs: dict[str, Any], n: int) -> np.ndarray:
    """The whole answer's waveform, decoded at once by the toy vocoder from the expected frames."""
    per_token = int(config.stage("talker").options["frames_per_token"])
    tokens = [t for t in answer_tokens(inputs, n) for _ in range(per_token)]
    frames = [{"codes": torch.tensor([(t + f) % 2048])} for f, t in enumerate(tokens)]
    vocoder = ToyVocoder(StageContext(config.stage("code2wav"), {}))
    state = vocoder.new_state(StagePayload("reference", {}, {}))
    return vocoder.decode(state, frames, final=True)["audio"]


def shm_gauge() -> float:
    """The shared memory the pipeline holds, from its gauge; a gauge that is not exported fails
    (a renamed or missing gauge must not read as an idle zero)."""
    value = REGISTRY.get_sample_value("pipeline_shm_bytes")
    assert value is not None, "pipeline_shm_bytes is not exported"
    return value


def held(stats: dict[str, StageStats]) -> dict[str, tuple[int, int, int]]:
    """(live requests, queue depth, shm bytes) of every stage that holds anything."""
    return {
        name: (s.live_requests, s.queue_depth, s.shm_bytes)
        for name, s in stats.items()
        if s.live_requests or s.queue_depth or s.shm_bytes
    }


async def wait_until(
    coordinator: Coordinator,
    condition: Callable[[dict[str, StageStats]], bool],
    what: str,
    timeout: float = 15.0,
) -> dict[str, StageStats]:
    """Poll fresh stage stats until ``condition`` holds; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await coordinator.stage_stats()
        if condition(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not {what} after {timeout}s: stages holding {held(stats)}, "
                f"{coordinator.requests_in_flight} in flight, shm gauge {shm_gauge()}"
            )
        await asyncio.sleep(0.01)


async def wait_clear(coordinator: Coordinator, timeout: float = 15.0) -> None:
    """Poll until no request is in flight and no stage holds state or shared memory."""
    await wait_until(
        coordinator,
        lambda stats: not held(stats) and coordinator.requests_in_flight == 0 and shm_gauge() == 0,
        "clear",
        timeout,
    )


def assert_no_live_state(stats: dict[str, StageStats]) -> None:
    """No stage holds per-request state or queued input (shared memory may still be in transit)."""
    assert {n: (s.live_requests, s.queue_depth) for n, s in stats.items()} == {
        n: (0, 0) for n in stats
    }


def own_segments(pids: list[int]) -> list[Path]:
    """Shared-memory segments still held by this test process or the given stage processes."""
    prefixes = tuple(f"duplex-{pid}-" for pid in [os.getpid(), *pids])
    return [p for p in leftover_segments() if p.name.startswith(prefixes)]


@asynccontextmanager
async def running(config: PipelineConfig, mode: str) -> AsyncIterator[Coordinator]:
    """A started pipeline; on exit it is closed and must have left no shared memory behind."""
    coordinator = await start_pipeline(config, mode=mode, ready_timeout=120)
    pids = list(coordinator.stage_pids.values())
    try:
        yield coordinator
    finally:
        await asyncio.wait_for(coordinator.close(), 30)
        assert own_segments(pids) == []
