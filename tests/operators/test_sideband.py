"""The sideband of a SIP call (``GET /v1/realtime?call_id=…``), end to end: sipp calls a duplex
server (the real app and its SIP stack, served by uvicorn in this process, the toy pipeline
in-process) or is called by it; the app follows and steers the call over a real WebSocket
(``websockets``), with the server's API key, as it would with OpenAI's sideband.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import websockets

from duplex.app_state import AppState
from duplex.app import create_app
from duplex.settings import load_preset
from duplex.transports.sip.agent import SipAgent
from duplex.transports.webrtc.ice import IcePolicy
from harness.server import free_port, write_preset
from tests.operators.conftest import toy_pipeline
from tests.operators.test_call_webhook import voiced_packets
from tests.telephony.peers import UdpPeer, sipp, wait_until
from tests.telephony.test_dial_out import callee

pytestmark = pytest.mark.e2e

KEY = "sk-sideband-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = 20.0
INSTRUCTIONS = "You are Sid, who talks on the phone while the app listens."


@dataclass
class Service:
    http: httpx.AsyncClient
    ws_url: str
    sip_port: int
    state: AppState
    agent: SipAgent

    def sideband(self, call_id: str, headers: dict[str, str] | None = AUTH):
        return websockets.connect(f"{self.ws_url}?call_id={call_id}", additional_headers=headers)


@pytest.fixture(scope="module")
def speech_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sipp's folder: speech.ulaw, what the callee of a placed call says (espeak-ng, sox)."""
    folder = tmp_path_factory.mktemp("sideband-sipp")
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "170", "-w", str(folder / "raw.wav"),
                    "hello agent"], check=True)
    subprocess.run(["sox", str(folder / "raw.wav"), "-r", "8000", "-c", "1", "-t", "ul",
                    str(folder / "speech.ulaw")], check=True)
    return folder


@pytest.fixture(scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Service]:
    tmp = tmp_path_factory.mktemp("sideband")
    sip_port, http_port = free_port(), free_port()
    # A silent caller sends no RTP: the inbound-media timeout must outlast each test.
    preset = write_preset(
        tmp / "preset.yaml", pipeline=toy_pipeline(6), pipeline_mode="inproc", max_sessions=2,
        sip_port=sip_port, rtp_ports="43600-43699", api_key=KEY,
        session={"inbound_media_timeout_s": 60})
    app = create_app(load_preset(["--config", str(preset), "--port", str(http_port)], environ={}),
                     IcePolicy(hosts=("127.0.0.1",)))
    state: AppState = app.state.duplex
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=http_port, log_config=None))
    serving = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started and state.serving_pipeline() is not None, 60)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=TIMEOUT,
                                 headers=AUTH) as http:
        yield Service(http, f"ws://127.0.0.1:{http_port}/v1/realtime", sip_port, state,
                      app.state.sip_agent)
    server.should_exit = True
    await serving


async def next_event(ws, kind: str, skipped: list[str] | None = None) -> dict[str, Any]:
    """The next server event of type ``kind``; the types of those before it go to ``skipped``."""
    async with asyncio.timeout(TIMEOUT):
        while True:
            message = json.loads(await ws.recv())
            if message["type"] == kind:
                return message
            if skipped is not None:
                skipped.append(message["type"])


async def refused(ws) -> tuple[dict[str, Any], int]:
    """The error event of a refused sideband, and its close code."""
    error = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), TIMEOUT)
    return error, closed.value.rcvd.code


async def test_the_sideband_follows_and_steers_an_incoming_call(service: Service,
                                                                speech_dir: Path) -> None:
    sink = await UdpPeer.open()
    caller = asyncio.create_task(sipp("call_wait_bye.xml", service.sip_port, speech_dir,
                                      ("rtp_sink", str(sink.port))))
    try:
        await wait_until(lambda: len(service.agent.live) == 1)
        call_id = next(iter(service.agent.live))
        # The same key as the other call endpoints.
        async with service.sideband(call_id, headers=None) as ws:
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), TIMEOUT)
            assert closed.value.rcvd.code == 1008
        async with service.sideband(call_id) as ws:
            created = await next_event(ws, "session.created")
            assert created["session"]["id"] == call_id
            # One sideband per call.
            async with service.sideband(call_id) as second:
                error, code = await refused(second)
                assert error["error"]["code"] == "sideband_in_use" and code == 1008
            # The app steers the call: its config, then a response the caller hears.
            await ws.send(json.dumps({"type": "session.update",
                                      "session": {"type": "realtime", "instructions": INSTRUCTIONS}}))
            updated = await next_event(ws, "session.updated")
            assert updated["session"]["instructions"] == INSTRUCTIONS
            await ws.send(json.dumps({"type": "response.create"}))
            before: list[str] = []
            done = await next_event(ws, "response.done", before)
            assert done["response"]["status"] == "completed"
            # The response's events, but not its audio: that went down the phone line.
            assert "response.created" in before and "response.output_audio_transcript.delta" in before
            assert "response.output_audio.delta" not in before
            packets: list = []
            await wait_until(lambda: voiced_packets(sink, packets) >= 25)
        # The sideband is gone; the call goes on, and a new sideband may attach.
        sink.drain()
        await wait_until(lambda: sink.queue.qsize() >= 10)  # RTP still flows to the caller
        assert call_id in service.agent.live
        async with service.sideband(call_id) as ws:
            await next_event(ws, "session.created")
            assert (await service.http.post(f"/v1/realtime/calls/{call_id}/hangup")).status_code == 200
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await next_event(ws, "never")
            assert closed.value.rcvd.code == 1000  # the call ended: its sideband closes
        rc, out = await asyncio.wait_for(caller, TIMEOUT)
        assert rc == 0, out
    finally:
        caller.cancel()
        sink.close()
    await wait_until(lambda: len(service.state.registry) == 0)


async def test_a_placed_call_has_a_sideband_from_its_answer(service: Service,
                                                            speech_dir: Path) -> None:
    """Opened as soon as the call is placed, the sideband waits for the answer and then gets the
    whole call."""
    sink = await UdpPeer.open()
    try:
        async with callee("dial_answer.xml", speech_dir, ("rtp_sink", str(sink.port))) as port:
            placed = await service.http.post("/v1/realtime/calls", json={
                "target_uri": f"sip:bob@127.0.0.1:{port}", "session": {"instructions": INSTRUCTIONS}})
            assert placed.status_code == 201, placed.text
            call_id = placed.json()["id"]
            # The callee rings for a second (dial_answer.xml): the sideband opens before the answer.
            state = (await service.http.get(f"/v1/realtime/calls/{call_id}")).json()["state"]
            assert state in ("dialing", "ringing")
            async with service.sideband(call_id) as ws:
                created = await next_event(ws, "session.created")
                assert created["session"]["instructions"] == INSTRUCTIONS
                assert call_id in service.agent.live  # attached once answered
                # The callee speaks (speech.ulaw): the turn's events reach the app.
                await next_event(ws, "input_audio_buffer.speech_started")
                await next_event(ws, "response.done")
                assert (await service.http.post(f"/v1/realtime/calls/{call_id}/hangup")).status_code == 200
    finally:
        sink.close()
    await wait_until(lambda: len(service.state.registry) == 0)


async def test_a_placed_call_that_fails_tells_its_sideband(service: Service,
                                                          speech_dir: Path) -> None:
    async with callee("dial_busy.xml", speech_dir) as port:
        placed = await service.http.post("/v1/realtime/calls", json={
            "target_uri": f"sip:bob@127.0.0.1:{port}"})
        async with service.sideband(placed.json()["id"]) as ws:
            error, code = await refused(ws)
    assert error["error"]["code"] == "call_not_answered" and code == 1008
    assert "failed (486 Busy Here)" in error["error"]["message"]


@pytest.mark.parametrize("call_id", ["sip_nobody", "rtc_123"])
async def test_no_sideband_without_a_live_sip_call(service: Service, call_id: str) -> None:
    async with service.sideband(call_id) as ws:
        error, code = await refused(ws)
    assert error["error"]["code"] == "call_not_found" and code == 1008
