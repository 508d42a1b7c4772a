"""One stage driven message by message (no coordinator): tombstones for late data, acknowledged
aborts, and faults that must be reported rather than hang the stage.

The test owns the endpoints around the stage (``coordinator``, an upstream ``thinker`` and a
downstream ``code2wav``), so it decides exactly when late data arrives; over ZMQ the late data
carries a tensor in shared memory that must go back to its sender.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.config import StageConfig
from pipeline.models import MergeFn, StageContext
from pipeline.models.toy import make_relay, make_talker
from pipeline.proto import (
    COORDINATOR,
    Abort,
    AbortAck,
    ControlMessage,
    Failed,
    Ready,
    Shutdown,
    StageCrashed,
    StagePayload,
    StageStats,
    StatsRequest,
    StreamChunk,
    StreamDone,
    Submit,
)
from pipeline.scheduling import build_scheduler
from pipeline.scheduling.base import ARSlot, ARStepResult, Scheduler, StepResult
from pipeline.stage import Stage
from pipeline.transport.base import Endpoint
from pipeline.transport.inproc import InprocHub
from pipeline.transport.zmq_ipc import ZmqEndpoint
from tests.pipeline.helpers import fan_in_config, toy_config

TALKER = toy_config().stage("talker")
JOIN = fan_in_config().stage("join")
PEERS = (COORDINATOR, "thinker", "code2wav", "a", "b")


class Harness:
    """A stage under test plus the endpoints around it, each with a queue of what it received."""

    def __init__(self, endpoints: dict[str, Endpoint], stage: Stage) -> None:
        self.endpoints = endpoints
        self.inbox: dict[str, asyncio.Queue[ControlMessage]] = {n: asyncio.Queue() for n in PEERS}
        self.taken: dict[str, list[ControlMessage]] = {n: [] for n in PEERS}
        self._pumps = [asyncio.create_task(self._pump(n)) for n in PEERS]
        self._stage = stage
        self._task = asyncio.create_task(stage.run())
        self._tokens = itertools.count(1)

    async def _pump(self, name: str) -> None:
        while True:  # receiving also applies shared-memory releases (ZMQ)
            self.inbox[name].put_nowait(await self.endpoints[name].recv())

    def send(self, source: str, message: ControlMessage) -> None:
        self.endpoints[source].send(self._stage.name, message)

    async def expect(self, name: str, kind: type, request_id: str | None = None) -> Any:
        """The next message of ``kind`` (for ``request_id``) at ``name``; periodic stats skipped."""
        async with asyncio.timeout(10):
            while True:
                message = await self.inbox[name].get()
                self.taken[name].append(message)
                if isinstance(message, StageStats) and message.token is None:
                    continue
                if isinstance(message, kind) and request_id in (None, _request_id(message)):
                    return message

    async def reported(self, condition: Callable[[StageStats], bool]) -> StageStats:
        """The first periodic stats report (sent by the stage's loop on its own) that satisfies
        ``condition``: it reflects the loop's queue even while the worker is busy."""
        async with asyncio.timeout(10):
            while True:
                message = await self.inbox[COORDINATOR].get()
                self.taken[COORDINATOR].append(message)
                if isinstance(message, StageStats) and message.token is None and condition(message):
                    return message

    async def stats(self) -> StageStats:
        token = next(self._tokens)
        self.send(COORDINATOR, StatsRequest(token))
        while True:
            stats = await self.expect(COORDINATOR, StageStats)
            if stats.token == token:
                return stats

    def received(self, name: str, request_id: str) -> list[ControlMessage]:
        """Everything that arrived at ``name`` so far for ``request_id``."""
        while not self.inbox[name].empty():
            self.taken[name].append(self.inbox[name].get_nowait())
        return [m for m in self.taken[name] if _request_id(m) == request_id]

    async def close(self) -> None:
        self.send(COORDINATOR, Shutdown())
        await asyncio.wait_for(self._task, 10)
        for pump in self._pumps:
            pump.cancel()
        for name in PEERS:
            self.endpoints[name].close()


def _request_id(message: ControlMessage) -> str | None:
    payload = getattr(message, "payload", None)
    return payload.request_id if payload is not None else getattr(message, "request_id", None)


def _endpoints(kind: str, directory: Path, names: list[str]) -> dict[str, Endpoint]:
    if kind == "zmq":
        return {n: ZmqEndpoint(n, directory, shm_threshold=1024) for n in names}
    hub = InprocHub()
    return {n: hub.endpoint(n) for n in names}


async def start(
    kind: str, directory: Path, config: StageConfig, scheduler: Scheduler, merge: MergeFn | None = None
) -> Harness:
    endpoints = _endpoints(kind, directory, [config.name, *PEERS])
    harness = Harness(endpoints, Stage(config, scheduler, endpoints[config.name], merge))
    await harness.expect(COORDINATOR, Ready)
    return harness


def token(request_id: str, token_id: int, hidden_floats: int = 4) -> StagePayload:
    return StagePayload(request_id, {"token_id": token_id, "hidden": torch.ones(hidden_floats)})


@pytest.mark.parametrize("kind", ["inproc", "zmq"])
async def test_late_data_after_an_abort_is_freed_and_never_recreates_state(
    kind: str, directory: Path
) -> None:
    talker = build_scheduler(TALKER, make_talker(StageContext(TALKER, {})))
    h = await start(kind, directory, TALKER, talker)
    try:
        h.send("thinker", StreamChunk(token("req-a", 5), "thinker", 0))
        await h.expect("code2wav", StreamChunk, "req-a")  # the talker is voicing the token
        assert (await h.stats()).live_requests == 1

        h.send(COORDINATOR, Abort("req-a"))
        await h.expect(COORDINATOR, AbortAck, "req-a")
        assert (await h.stats()).live_requests == 0

        # Late data: a chunk whose 64 KiB hidden state rides shared memory, the end of the stream.
        h.send("thinker", StreamChunk(token("req-a", 6, hidden_floats=16384), "thinker", 1))
        h.send("thinker", StreamDone(StagePayload("req-a", {}), "thinker", 2))
        stats = await h.stats()
        assert (stats.live_requests, stats.queue_depth) == (0, 0)
        deadline = time.monotonic() + 10
        while h.endpoints["thinker"].shm_bytes():  # the receiver copied it out and released it
            assert time.monotonic() < deadline, "late data's shared memory never released"
            await asyncio.sleep(0.01)

        # An abort again is acknowledged again; an abort before any data makes that data late too.
        h.send(COORDINATOR, Abort("req-a"))
        await h.expect(COORDINATOR, AbortAck, "req-a")
        h.send(COORDINATOR, Abort("req-b"))
        await h.expect(COORDINATOR, AbortAck, "req-b")
        h.send("thinker", StreamChunk(token("req-b", 8), "thinker", 0))
        assert (await h.stats()).live_requests == 0

        # The stage still serves: a new request is voiced and ends (its end arrives after anything
        # the stage could have sent for the aborted ones).
        h.send("thinker", StreamChunk(token("req-c", 7), "thinker", 0))
        h.send("thinker", StreamDone(StagePayload("req-c", {}), "thinker", 1))
        await h.expect("code2wav", StreamDone, "req-c")
        per_token = int(TALKER.options["frames_per_token"])
        assert len(h.received("code2wav", "req-a")) <= per_token  # only frames of token 5
        assert h.received("code2wav", "req-b") == []
        assert (await h.stats()).live_requests == 0
    finally:
        await h.close()


class _GatedPromptedRunner:
    """An ARRunner that, like Qwen3-Omni's talker, can only run once the prompt (carried by a
    request's first chunk) arrived, and whose steps each wait for the test to open a gate."""

    def __init__(self) -> None:
        self.gate = threading.Semaphore(0)
        self.stepping = threading.Event()
        self.states_created = 0

    def new_state(self, payload: StagePayload) -> dict[str, Any]:
        self.states_created += 1
        return {"prompt": None, "pending": 0}

    def feed(self, slot: ARSlot, payload: StagePayload) -> None:
        slot.state["prompt"] = payload.data.get("prompt", slot.state["prompt"])
        slot.state["pending"] += 1

    def close_input(self, slot: ARSlot, payload: StagePayload) -> None:
        """Nothing to do: the test's streams end by the output cap."""

    def runnable(self, slot: ARSlot) -> bool:
        return slot.state["prompt"] is not None and slot.state["pending"] > 0

    def output_cap(self, slot: ARSlot) -> int | None:
        return None

    def step(self, slots: list[ARSlot]) -> list[ARStepResult]:
        self.stepping.set()
        assert self.gate.acquire(timeout=10), "the test never opened the gate"
        for slot in slots:
            slot.state["pending"] -= 1
        return [ARStepResult({"step": slot.steps}) for slot in slots]

    def finish(self, slot: ARSlot, capped: bool) -> dict[str, Any] | None:
        return None

    def release(self, slot: ARSlot) -> None:
        slot.state = None


async def test_input_queued_before_a_request_ended_does_not_recreate_its_state(
    directory: Path,
) -> None:
    """The talker reaches its output cap while more of the thinker's stream is already queued for
    it: that input must be dropped, not start a new request state that nothing would ever end."""
    config = TALKER.model_copy(update={"max_new_tokens": 1})
    runner = _GatedPromptedRunner()
    h = await start("inproc", directory, config, build_scheduler(config, runner))
    try:
        h.send("thinker", StreamChunk(StagePayload("req-a", {"prompt": "hi"}), "thinker", 0))
        assert await asyncio.to_thread(runner.stepping.wait, 10)  # first step, gate closed
        h.send("thinker", StreamChunk(StagePayload("req-a", {}), "thinker", 1))
        h.send("thinker", StreamChunk(StagePayload("req-a", {}), "thinker", 2))
        await h.reported(lambda stats: stats.queue_depth >= 2)  # both queued behind the step
        runner.gate.release(10)
        done = await h.expect("code2wav", StreamDone, "req-a")  # capped after one step
        assert done.payload.data == {}
        stats = await h.stats()
        assert (stats.live_requests, stats.queue_depth) == (0, 0)
        assert runner.states_created == 1
    finally:
        await h.close()


async def test_an_abort_for_a_request_the_stage_does_not_hold_skips_the_busy_worker(
    directory: Path,
) -> None:
    config = TALKER.model_copy(update={"max_new_tokens": 1})
    runner = _GatedPromptedRunner()
    h = await start("inproc", directory, config, build_scheduler(config, runner))
    try:
        h.send("thinker", StreamChunk(StagePayload("req-a", {"prompt": "hi"}), "thinker", 0))
        assert await asyncio.to_thread(runner.stepping.wait, 10)  # the worker is stuck in a step
        h.send(COORDINATOR, Abort("req-elsewhere"))
        await h.expect(COORDINATOR, AbortAck, "req-elsewhere")
        h.send(COORDINATOR, Abort("req-a"))  # held here: acknowledged once the step is over
        runner.gate.release()
        await h.expect(COORDINATOR, AbortAck, "req-a")
        assert (await h.stats()).live_requests == 0
    finally:
        await h.close()


class _FaultyScheduler:
    """Holds requests like a scheduler; its release or its step raises on demand."""

    def __init__(self, failing_step: bool) -> None:
        self._failing_step = failing_step
        self._live: set[str] = set()

    def add(self, payload: StagePayload) -> None:
        self._live.add(payload.request_id)

    feed = close_stream = add

    def abort(self, request_id: str) -> None:
        self._live.discard(request_id)
        raise RuntimeError("release failed")

    def has_work(self) -> bool:
        return self._failing_step and bool(self._live)

    def step(self) -> list[StepResult]:
        raise RuntimeError("scheduler bug")

    def live_requests(self) -> int:
        return len(self._live)

    def queue_depth(self) -> int:
        return 0


async def test_an_abort_is_acknowledged_even_when_the_release_raises(directory: Path) -> None:
    h = await start("inproc", directory, TALKER, _FaultyScheduler(failing_step=False))
    try:
        h.send("thinker", StreamChunk(token("req-a", 1), "thinker", 0))
        assert (await h.stats()).live_requests == 1
        h.send(COORDINATOR, Abort("req-a"))
        await h.expect(COORDINATOR, AbortAck, "req-a")
        assert (await h.stats()).live_requests == 0
    finally:
        await h.close()


async def test_a_step_that_raises_is_reported_as_a_crash(directory: Path) -> None:
    h = await start("inproc", directory, TALKER, _FaultyScheduler(failing_step=True))
    try:
        h.send("thinker", StreamChunk(token("req-a", 1), "thinker", 0))
        crash = await h.expect(COORDINATOR, StageCrashed)
        assert crash.source == TALKER.name and "scheduler bug" in crash.error
    finally:
        await h.close()


def _broken_merge(parts: dict[str, StagePayload]) -> StagePayload:
    raise ValueError("cannot merge")


async def test_a_merge_that_raises_fails_only_its_request(directory: Path) -> None:
    relay = build_scheduler(JOIN, make_relay(StageContext(JOIN, {})))
    h = await start("inproc", directory, JOIN, relay, merge=_broken_merge)
    try:
        for source in ("a", "b"):
            h.send(source, Submit(StagePayload("req-a", {"x": 1}), source))
        failed = await h.expect(COORDINATOR, Failed, "req-a")
        assert failed.source == "join" and "cannot merge" in failed.error
        assert (await h.stats()).live_requests == 0
        h.send(COORDINATOR, Abort("req-a"))  # the stage still serves its control plane
        await h.expect(COORDINATOR, AbortAck, "req-a")
    finally:
        await h.close()
