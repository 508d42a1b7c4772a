"""Out-of-band text responses (``conversation: "none"``, text only) run beside the conversation's,
but one session may run only ``MAX_BESIDE_RESPONSES`` of them at a time: past that, the client
gets an ``error`` (``too_many_responses``) and nothing reaches the pipeline, so that one client
cannot fill the pipeline's slots and fail everyone else's turns as ``overloaded``.

A scripted pipeline for the session's bound; a real server (the toy preset, its pipeline at 32
requests in flight) for the other session's turn.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from websockets.asyncio.client import connect

from duplex.session.session import MAX_BESIDE_RESPONSES
from harness.scripted_pipeline import ScriptedPipeline
from harness.server import ServerProcess, run_server, write_preset
from tests.api.helpers import PIPELINE, SHORT_ANSWER, TIMEOUT, realtime, user_text
from tests.duplex.test_session_scripted import Host

SIDE = json.dumps({"type": "response.create",
                   "response": {"conversation": "none", "output_modalities": ["text"]}})


async def test_out_of_band_responses_past_the_bound_are_refused_and_never_reach_the_pipeline() -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline)
    for _ in range(MAX_BESIDE_RESPONSES + 2):
        host.binding.receive(SIDE)
    await host.until(lambda: len(host.of("error")) == 2)
    assert len(pipeline.requests) == len(host.of("response.created")) == MAX_BESIDE_RESPONSES
    # Each is the session's in the pipeline's fair share (pipeline/admission.py).
    assert {request.owner for request in pipeline.requests} == {host.session.id}
    error = host.of("error")[0]["error"]
    assert error["code"] == "too_many_responses" and str(MAX_BESIDE_RESPONSES) in error["message"]
    # One ends: another may run.
    pipeline.end(pipeline.requests[0].request_id)
    await host.until(lambda: "response.done" in host.types())
    host.binding.receive(SIDE)
    await host.until(lambda: len(pipeline.requests) == MAX_BESIDE_RESPONSES + 1)
    for request in pipeline.requests[1:]:
        pipeline.end(request.request_id)
    await host.until(lambda: len(host.of("response.done")) == MAX_BESIDE_RESPONSES + 1)
    await host.binding.end("test over")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("out_of_band")
    with run_server(write_preset(tmp / "preset.yaml", pipeline=PIPELINE), tmp=tmp) as running:
        yield running


async def test_one_sessions_out_of_band_flood_leaves_another_sessions_turn_answered(
        server: ServerProcess) -> None:
    ws_url = server.url.replace("http", "ws", 1) + "/v1/realtime?model=gpt-realtime"
    async with connect(ws_url, max_queue=None) as flooder, realtime(server) as caller:
        await caller.wait("session.created")
        for _ in range(60):
            await flooder.send(SIDE)
        # While the flood is being handled: the other session's turn.
        await caller.connection.conversation.item.create(item=user_text("Hello there"))
        await caller.connection.response.create(response={"max_output_tokens": SHORT_ANSWER})
        done = await caller.wait("response.done")
        assert done.response.status == "completed", done.response.status_details
        # Every create of the flood was answered or refused; refused past the bound.
        refused: list[str] = []
        created = 0
        async with asyncio.timeout(TIMEOUT):
            while created + len(refused) < 60:
                message = json.loads(await flooder.recv())
                created += message["type"] == "response.created"
                if message["type"] == "error":
                    refused.append(message["error"]["code"])
        assert refused and set(refused) == {"too_many_responses"}, refused
