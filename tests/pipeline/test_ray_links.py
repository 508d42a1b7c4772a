"""The Ray transport's links without a cluster: a batch that cannot be delivered (the target actor
is away, or the batch cannot be pickled) fails the requests whose data it carried, at once, on
the front end that sent them or the one their stage answers (the end-to-end case, through a
coordinator on a real cluster, is in ``test_ray_placement.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray")
from ray.exceptions import RayError

from pipeline.proto import Abort, Failed, StagePayload, StatsRequest, StreamChunk, Submit
from pipeline.transport.ray_endpoint import FrontEndpoint, StageEndpoint
from pipeline.transport.ray_wire import decode, encode


class _Away:
    """An actor handle whose calls fail, as those to a dead or unreachable actor do."""

    class deliver:  # named as the actor method it stands for
        @staticmethod
        async def remote(data: bytes) -> None:
            raise RayError("the actor is unreachable")


def payload(rid: str) -> StagePayload:
    return StagePayload(rid, {"text": "hi"}, {})


async def test_a_submit_that_is_not_delivered_fails_its_request_on_the_front_end() -> None:
    front = FrontEndpoint({"thinker": _Away()}, ["thinker"], lambda stage, why: None)
    front.send("thinker", StatsRequest(1))  # lost too, but it ends by its own timeout
    front.send("thinker", Submit(payload("req-1"), "coordinator"))
    front.send("thinker", Abort("req-0"))
    message = await asyncio.wait_for(front.recv(), 5)
    assert isinstance(message, Failed) and message.request_id == "req-1", message
    assert "lost on the way to stage thinker" in message.error and "unreachable" in message.error
    front.close()


async def test_an_output_that_is_not_delivered_fails_its_request_on_its_front_end() -> None:
    stage = StageEndpoint("thinker", lambda target: _Away(), lambda: None)
    await stage.poll("front-a", hello=True, wait=0)
    stage.accept(encode([("front-a", Submit(payload("req-2"), "coordinator"))]))
    await stage.recv()
    for seq in range(3):  # one batch, one request: failed once
        stage.send("talker", StreamChunk(payload("req-2"), "thinker", seq))
    data = await asyncio.wait_for(stage.poll("front-a", hello=False, wait=5), 6)
    messages: list[Any] = [m for _, m in decode(data)]
    assert [(type(m), m.request_id) for m in messages] == [(Failed, "req-2")], messages
    assert messages[0].source == "thinker" and "talker" in messages[0].error
    stage.close()


async def test_an_unpicklable_batch_fails_its_request() -> None:
    front = FrontEndpoint({"thinker": _Away()}, ["thinker"], lambda stage, why: None)
    front.send("thinker", Submit(StagePayload("req-3", {}, {"bad": lambda: None}), "coordinator"))
    message = await asyncio.wait_for(front.recv(), 5)
    assert isinstance(message, Failed) and message.request_id == "req-3"
    assert "lost on the way" in message.error
    front.close()
