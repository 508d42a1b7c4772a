"""Aborts jump ahead of data in a busy stage (the urgent lane of the endpoint's inbox and of the
stage's worker), checked by the order of events, not by timing:

- in the worker: with the worker stuck in a step and hundreds of data commands queued behind it,
  an abort that arrives after them releases its request before any of them is applied, and the
  commands queued for the aborted request itself are skipped (they would recreate its state);
- in the stage's event loop: an abort sent after a burst of data is handled before that data, so
  the data of the aborted request is dropped unprocessed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pipeline.models import StageContext
from pipeline.models.toy import make_relay
from pipeline.proto import COORDINATOR, Abort, AbortAck, Ready, StagePayload, StreamChunk, Submit
from pipeline.scheduling import build_scheduler
from pipeline.scheduling.base import ARSlot
from pipeline.stage import Stage
from pipeline.transport.inproc import InprocHub
from pipeline.transport.zmq_ipc import ZmqEndpoint
from tests.pipeline.test_stage import JOIN, PEERS, TALKER, Harness, _GatedPromptedRunner

FLOOD = 300


class _RecordingRunner(_GatedPromptedRunner):
    """test_stage's gated runner, its prompt given from the start, that also records, in order,
    every input it is fed and every request it releases (from the worker thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def new_state(self, payload: StagePayload) -> dict[str, Any]:
        return {**super().new_state(payload), "prompt": "given"}

    def feed(self, slot: ARSlot, payload: StagePayload) -> None:
        self.events.append(("feed", slot.request_id))
        super().feed(slot, payload)

    def release(self, slot: ARSlot) -> None:
        self.events.append(("release", slot.request_id))
        super().release(slot)


@pytest.mark.parametrize("kind", ["inproc", "zmq"])
async def test_an_abort_overtakes_the_data_queued_in_a_busy_worker(kind: str, directory: Path) -> None:
    config = TALKER.model_copy(update={"max_new_tokens": 100000})
    runner = _RecordingRunner()
    names = (config.name, *PEERS)
    if kind == "zmq":
        endpoints = {n: ZmqEndpoint(n, directory, shm_threshold=1 << 20) for n in names}
    else:
        hub = InprocHub()
        endpoints = {n: hub.endpoint(n) for n in names}
    h = Harness(endpoints, Stage(config, build_scheduler(config, runner), endpoints[config.name]))
    try:
        await h.expect(COORDINATOR, Ready)
        h.send("thinker", StreamChunk(StagePayload("req-a", {}), "thinker", 0))
        # The worker is inside req-a's step, its gate closed.
        assert await asyncio.to_thread(runner.stepping.wait, 10)
        for seq in (1, 2):  # queued for req-a itself: skipped, never a new state for it
            h.send("thinker", StreamChunk(StagePayload("req-a", {}), "thinker", seq))
        for seq in range(FLOOD):
            h.send("thinker", StreamChunk(StagePayload("req-b", {}), "thinker", seq))
        await h.reported(lambda stats: stats.queue_depth >= FLOOD)  # all queued in the worker
        h.send(COORDINATOR, Abort("req-a"))
        # Acknowledged by the loop at once (not held here), after it queued req-a's abort.
        h.send(COORDINATOR, Abort("req-elsewhere"))
        await h.expect(COORDINATOR, AbortAck, "req-elsewhere")
        runner.gate.release(FLOOD + 1)
        await h.expect(COORDINATOR, AbortAck, "req-a")
        await h.stats()  # answered once the worker applied every command queued before it
        h.send(COORDINATOR, Abort("req-b"))
        await h.expect(COORDINATOR, AbortAck, "req-b")
        events = list(runner.events)
        released_a = events.index(("release", "req-a"))
        first_b = events.index(("feed", "req-b"))
        assert released_a < first_b, events[:5]
        assert events.count(("feed", "req-a")) == 1 and events.count(("release", "req-a")) == 1
        assert events.count(("feed", "req-b")) == FLOOD  # the data itself was not lost
        assert (await h.stats()).live_requests == 0
    finally:
        runner.gate.release(FLOOD)
        await h.close()


async def test_an_abort_is_handled_before_the_data_sent_ahead_of_it(directory: Path) -> None:
    """A burst of fan-in parts then an abort of the last request, all sent before the stage's loop
    runs: the abort is handled first, so the aborted request's parts are never merged."""
    merged: list[str] = []

    def merge(parts: dict[str, StagePayload]) -> StagePayload:
        merged.append(parts["a"].request_id)
        return parts["a"]

    hub = InprocHub()
    endpoints = {n: hub.endpoint(n) for n in (JOIN.name, *PEERS)}
    relay = build_scheduler(JOIN, make_relay(StageContext(JOIN, {})))
    h = Harness(endpoints, Stage(JOIN, relay, endpoints[JOIN.name], merge))
    try:
        await h.expect(COORDINATOR, Ready)
        rids = [f"req-{i}" for i in range(FLOOD)]
        for rid in rids:
            for source in ("a", "b"):
                h.send(source, Submit(StagePayload(rid, {"x": 1}), source))
        h.send(COORDINATOR, Abort(rids[-1]))  # no await since the first send: one burst
        await h.expect(COORDINATOR, AbortAck, rids[-1])
        await h.stats()  # answered after the loop handled every part of the burst
        assert merged == rids[:-1]
    finally:
        await h.close()
