"""An abort that a stage keeping conversation state did not acknowledge in time (its ack lost, the
Abort itself lost on the way, the stage stuck) leaves that stage's state unknown: the book must
not count the cut turn as kept, or the next request would continue a state the stage may not
have. The coordinator drops the conversation's kept state instead, and the next request starts
afresh. Model-free: the test plays the one stage on an in-process endpoint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from pipeline.config import parse_pipeline_config
from pipeline.coordinator import Coordinator
from pipeline.proto import (
    COORDINATOR,
    Abort,
    AbortAck,
    DropConversation,
    OmniRequest,
    Ready,
    StageStats,
    StatsRequest,
    StreamDone,
    Submit,
)
from pipeline.scheduling.conversations import CONVERSATION_PARAM
from pipeline.transport.inproc import InprocEndpoint, InprocHub

CONFIG = parse_pipeline_config({
    "model": "toy",
    "entry": "thinker",
    "stages": [{"name": "thinker", "runner": "thinker", "scheduler": "simple", "terminal": True}],
    "abort_timeout_s": 0.3,
})


@dataclass
class FakeThinker:
    """The pipeline's one stage, keeping conversations: it answers a Submit at once (unless its
    params say ``hold``), answers stats, and acknowledges aborts unless ``silent``."""

    endpoint: InprocEndpoint
    silent: bool = False
    submits: asyncio.Queue[Submit] = field(default_factory=asyncio.Queue)
    seen: list[Any] = field(default_factory=list)

    async def serve(self) -> None:
        self.endpoint.send(COORDINATOR, Ready("thinker", keeps_conversations=True))
        while True:
            message = await self.endpoint.recv()
            self.seen.append(message)
            match message:
                case Submit(payload=payload):
                    self.submits.put_nowait(message)
                    if not payload.params.get("hold"):
                        self.endpoint.send(COORDINATOR, StreamDone(payload, "thinker", 0))
                case StatsRequest(token=token):
                    self.endpoint.send(COORDINATOR, StageStats("thinker", 0, 0, token=token))
                case Abort(request_id=rid, keep_answer_tokens=keep) if not self.silent:
                    self.endpoint.send(COORDINATOR, AbortAck(rid, "thinker", rid if keep else None))


@pytest.fixture
async def pipeline() -> AsyncIterator[tuple[Coordinator, FakeThinker]]:
    hub = InprocHub()
    coordinator = Coordinator(CONFIG, hub.endpoint(COORDINATOR), None)
    stage = FakeThinker(hub.endpoint("thinker"))
    serving = asyncio.create_task(stage.serve())
    coordinator.start()
    await coordinator.wait_ready(5)
    yield coordinator, stage
    await coordinator.close()
    serving.cancel()


def message(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "text": text, "audio": None, "sample_rate": None}


def request(rid: str, *texts: str, **params: Any) -> OmniRequest:
    roles = ("user", "assistant")
    messages = [message(roles[i % 2], text) for i, text in enumerate(texts)]
    return OmniRequest(rid, {"messages": messages}, {"conversation_id": "c", **params})


async def resumed(stage: FakeThinker) -> bool:
    submit = await asyncio.wait_for(stage.submits.get(), 5)
    return bool(submit.payload.params[CONVERSATION_PARAM]["resume"])


async def test_a_cut_that_a_keeping_stage_did_not_acknowledge_is_not_kept(
    pipeline: tuple[Coordinator, FakeThinker],
) -> None:
    coordinator, stage = pipeline
    async for _ in coordinator.stream(request("r1", "one")):
        pass
    assert not await resumed(stage)
    barged = coordinator.stream(request("r2", "one", "answer", "two", hold=True))
    answer = asyncio.create_task(anext(barged, None))
    assert await resumed(stage)  # it continues r1's kept state
    stage.silent = True  # the Abort (or its ack) is lost
    await asyncio.wait_for(coordinator.abort("r2", keep_answer_tokens=1), 5)  # by its timeout
    assert await answer is None
    await barged.aclose()
    stage.silent = False
    async for _ in coordinator.stream(request("r3", "one", "answer", "two", "ans", "three")):
        pass
    assert not await resumed(stage), "continued a kept state that the stage never vouched for"
    assert DropConversation("c", None) in stage.seen


async def test_a_cut_of_an_ended_answer_that_was_not_acknowledged_is_not_kept(
    pipeline: tuple[Coordinator, FakeThinker],
) -> None:
    coordinator, stage = pipeline
    async for _ in coordinator.stream(request("r1", "one")):
        pass
    assert not await resumed(stage)
    stage.silent = True  # the answer ended, its audio still plays: the barge-in's cut is lost
    await asyncio.wait_for(coordinator.abort("r1", keep_answer_tokens=1), 5)
    stage.silent = False
    async for _ in coordinator.stream(request("r2", "one", "ans", "two")):
        pass
    assert not await resumed(stage), "continued a kept state that the stage never vouched for"
    assert DropConversation("c", None) in stage.seen
