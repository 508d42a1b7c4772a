"""The built-in ``transfer_call`` tool (duplex/tools/transfer_call.py), end to end: sipp calls a
duplex server (the real app and its SIP stack, served by uvicorn in this process, the toy pipeline
in-process) whose preset enables the tool with one target, ``desk``; the app accepts the call
through the webhook and follows it over the call's sideband. The toy model calls the tool when the
response's ``tool_choice`` names it. sipp plays the caller's PBX: it checks that the REFER names
the desk's URI (tests/telephony/scenarios/webhook_transfer*.xml), then reports the target's call.
A caller that gets a REFER it does not expect fails its scenario: "nothing was sent" is sipp's exit
status. A Realtime WebSocket session and a WebRTC call (a real aiortc peer) of the same server are
not offered the tool.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import websockets
from aiortc import RTCSessionDescription

from duplex.media.recording import file_stem
from harness.mic import ScriptedMic
from harness.peers import ClientPeer
from harness.scripted_pipeline import ScriptedPipeline
from harness.server import free_port, write_preset
from tests.operators.conftest import served, toy_pipeline
from tests.operators.test_call_webhook import (
    SECRET,
    TARGET,
    Receiver,
    Service,
    calling,
    receiving,
    say_ulaw,
)
from tests.telephony.peers import wait_until

pytestmark = pytest.mark.e2e

TIMEOUT = 20.0
FORCED = {"type": "function", "name": "transfer_call"}
TONE = (0.3 * np.sin(2 * np.pi * 300 * np.arange(48000) / 24000)).astype(np.float32)  # 2 s
TRANSFER_CALL = {"enabled": True, "targets": {"desk": {"uri": TARGET, "description": "the front desk"}}}


@pytest.fixture(scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Service]:
    tmp = tmp_path_factory.mktemp("transfer-call")
    say_ulaw(tmp, "Please put me through to the accounts department.")
    receiver = Receiver()
    sip_port = free_port()
    recordings = tmp / "calls"
    recordings.mkdir()
    async with receiving(receiver) as webhook_url:
        preset = write_preset(
            tmp / "preset.yaml", pipeline=toy_pipeline(6), pipeline_mode="inproc", max_sessions=2,
            sip_port=sip_port, rtp_ports="43800-43899", call_webhook=webhook_url,
            call_webhook_secret=SECRET, call_decision_timeout_s=5, record_dir=str(recordings),
            transfer_call=TRANSFER_CALL, session={"inbound_media_timeout_s": 60})
        async with served(preset, TIMEOUT) as server:
            yield Service(server.http, sip_port, server.state, server.app, server.pipeline, receiver,
                          tmp, recordings)


def ws_url(service: Service) -> str:
    return str(service.http.base_url).replace("http://", "ws://").rstrip("/") + "/v1/realtime"


async def events_until(ws, done: Any) -> list[dict[str, Any]]:
    """The server events until ``done(events)`` holds or the socket closes."""
    events: list[dict[str, Any]] = []
    async with asyncio.timeout(TIMEOUT):
        while not done(events):
            try:
                events.append(json.loads(await ws.recv()))
            except websockets.ConnectionClosed:
                break
    return events


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def outputs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function_call_output items the server added."""
    return [e["item"] for e in of(events, "conversation.item.added")
            if e["item"]["type"] == "function_call_output"]


def the_call(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The model's call, as its arguments' done event tells it (the server runs it after that)."""
    (call,) = of(events, "response.function_call_arguments.done")
    return call


def offered(params: dict[str, Any]) -> dict[str, Any] | None:
    """The transfer_call tool a pipeline request offered the model, if any."""
    return next((t for t in params.get("tools") or [] if t["name"] == "transfer_call"), None)


async def accepted(service: Service) -> str:
    call_id = await service.receiver.next_call()
    assert (await service.decide(call_id, "accept", {})).status_code == 200
    return call_id


async def test_the_models_transfer_call_reaches_the_caller_as_a_refer(service: Service) -> None:
    async with calling(service, "webhook_transfer.xml"):  # its REFER must name TARGET
        call_id = await accepted(service)
        async with websockets.connect(f"{ws_url(service)}?call_id={call_id}") as ws:
            await events_until(ws, lambda seen: of(seen, "session.created"))
            asked = len(service.pipeline.requests)
            await ws.send(json.dumps({"type": "response.create", "response": {"tool_choice": FORCED}}))
            # The call ends with the transfer: the sideband closes after the events queued.
            events = await events_until(ws, lambda seen: False)
    # The model was offered the tool by the target's name, never its URI.
    tool = offered(service.pipeline.requests[asked].params)
    assert tool is not None and tool["parameters"]["properties"]["target"]["enum"] == ["desk"]
    assert TARGET not in json.dumps(service.pipeline.requests[asked].params)
    call = the_call(events)
    assert call["name"] == "transfer_call"
    (added,) = of(events, "response.output_item.added")
    assert added["item"]["type"] == "function_call" and added["item"]["call_id"] == call["call_id"]
    transfer = [(e["type"], e["status"]) for e in events if e["type"].startswith("call.transfer.")]
    assert transfer == [("call.transfer.progress", 202), ("call.transfer.progress", 100),
                        ("call.transfer.progress", 200), ("call.transfer.completed", 200)]
    assert {e["target_uri"] for e in events if e["type"].startswith("call.transfer.")} == {TARGET}
    (output,) = outputs(events)
    assert output["call_id"] == call["call_id"]
    assert json.loads(output["output"]) == {"status": "completed", "target": "desk",
                                            "sip_status": 200, "sip_reason": "OK"}
    # In order: the arguments are done before the REFER goes, the output comes with the outcome.
    types = [e["type"] for e in events]
    assert types.index("response.function_call_arguments.done") < types.index("call.transfer.progress")
    assert types.index("call.transfer.completed") < types.index("conversation.item.added",
                                                                 types.index("call.transfer.completed"))
    await wait_until(service.idle)


async def test_a_refused_transfer_is_the_calls_failed_output_and_the_agent_says_so(
        service: Service) -> None:
    async with calling(service, "webhook_transfer_refused.xml"):  # 603 to the REFER, then BYE
        call_id = await accepted(service)
        async with websockets.connect(f"{ws_url(service)}?call_id={call_id}") as ws:
            await events_until(ws, lambda seen: of(seen, "session.created"))
            asked = len(service.pipeline.requests)
            await ws.send(json.dumps({"type": "response.create", "response": {"tool_choice": FORCED}}))
            events = await events_until(ws, lambda seen: len(of(seen, "response.done")) == 2)
        (output,) = outputs(events)
        assert output["call_id"] == the_call(events)["call_id"]
        assert json.loads(output["output"]) == {"status": "failed", "target": "desk",
                                                "sip_status": 603, "sip_reason": "Decline"}
        # The call goes on with the agent, who answers the failure in words (offered no tools).
        first, follow_up = (d["response"] for d in of(events, "response.done"))
        assert first["status"] == follow_up["status"] == "completed"
        assert [o["type"] for o in follow_up["output"]] == ["message"]
        assert offered(service.pipeline.requests[asked].params) is not None
        assert "tools" not in service.pipeline.requests[-1].params
        assert service.state.registry.get(call_id) is not None
        assert (await service.decide(call_id, "hangup")).status_code == 200
    await wait_until(service.idle)


async def test_an_unknown_target_is_an_error_output_and_nothing_is_sent(service: Service) -> None:
    """A model that says it transfers the caller, then names no configured target (a scripted
    pipeline gives its words and the call's arguments): the call runs once its words were played
    to the caller, its output is an error, the agent answers it, and the caller gets no REFER
    (sipp's webhook_answered.xml fails on one)."""
    toy = service.state.pipeline
    scripted = ScriptedPipeline()
    service.state.pipeline = scripted  # type: ignore[assignment]
    try:
        async with calling(service, "webhook_answered.xml"):
            call_id = await accepted(service)
            async with websockets.connect(f"{ws_url(service)}?call_id={call_id}") as ws:
                await events_until(ws, lambda seen: of(seen, "session.created"))
                await wait_until(lambda: len(scripted.requests) == 1, TIMEOUT)  # the caller's turn
                assert offered(scripted.requests[0].params) is not None
                words = "Let me put you through."
                scripted.push(text=words, audio=TONE, sample_rate=24000, spoken_text=words)
                scripted.push(function_call={"name": "transfer_call",
                                             "arguments": '{"target": "sip:evil@attacker.example"}'})
                scripted.end()
                await wait_until(lambda: len(scripted.requests) == 2, TIMEOUT)
                scripted.push(text="Sorry, I cannot transfer you there.")
                scripted.end()
                events = await events_until(ws, lambda seen: len(of(seen, "response.done")) == 2)
            (output,) = outputs(events)
            call = the_call(events)
            assert output["call_id"] == call["call_id"]
            error = json.loads(output["output"])
            assert error["status"] == "error" and "no target named" in error["error"]
            assert "desk" in error["error"]
            assert not [e for e in events if e["type"].startswith("call.transfer.")]
            # The follow-up is given the error, and no tools.
            assert "tools" not in scripted.requests[1].params
            assert "no target named" in json.dumps(scripted.requests[1].inputs["messages"][-1])
            assert (await service.decide(call_id, "hangup")).status_code == 200
    finally:
        service.state.pipeline = toy
    await wait_until(service.idle)
    # The words were heard first: 2 s of audio paced to the caller at real time (the recording's
    # log has when each event went out, on the call's clock).
    path = service.recordings / f"{file_stem(call_id)}.jsonl"
    sent = [json.loads(line) for line in path.read_text().splitlines()]
    sent = [(line["t"], line["event"]["type"]) for line in sent if line["kind"] == "server"]
    said = next(t for t, kind in sent if kind == "response.output_audio_transcript.delta")
    ran = next(t for t, kind in sent if kind == "response.function_call_arguments.done")
    assert ran - said >= 1.9, (said, ran)


async def test_a_websocket_session_is_not_offered_the_tool(service: Service) -> None:
    async with websockets.connect(f"{ws_url(service)}?model=toy") as ws:
        await events_until(ws, lambda seen: of(seen, "session.created"))
        asked = len(service.pipeline.requests)
        # The toy calls a function a response's tool_choice names whenever it is offered tools.
        await ws.send(json.dumps({"type": "response.create", "response": {"tool_choice": FORCED}}))
        events = await events_until(ws, lambda seen: of(seen, "response.done"))
    (done,) = of(events, "response.done")
    assert [o["type"] for o in done["response"]["output"]] == ["message"]
    assert offered(service.pipeline.requests[asked].params) is None
    await wait_until(service.idle)


async def test_a_webrtc_call_is_not_offered_the_tool(service: Service) -> None:
    peer = ClientPeer(ScriptedMic())
    try:
        answer = await service.http.post("/v1/realtime/calls", content=await peer.offer(),
                                         headers={"Content-Type": "application/sdp"})
        assert answer.status_code == 201, answer.text
        await peer.pc.setRemoteDescription(
            RTCSessionDescription(peer.policy.filter_candidates(answer.text), "answer"))
        await peer.wait_for(lambda: of(peer.events(), "session.created"))
        asked = len(service.pipeline.requests)
        peer.send({"type": "response.create", "response": {"tool_choice": FORCED}})
        await peer.wait_for(lambda: of(peer.events(), "response.done"))
        (done,) = of(peer.events(), "response.done")
        assert [o["type"] for o in done["response"]["output"]] == ["message"]
        assert offered(service.pipeline.requests[asked].params) is None
        call_id = answer.headers["location"].rsplit("/", 1)[1]
        assert (await service.http.post(f"/v1/realtime/calls/{call_id}/hangup")).status_code == 200
    finally:
        await peer.close()
    await wait_until(service.idle)
