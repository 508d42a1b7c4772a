"""Dialling out through the API, end to end: ``POST /v1/realtime/calls`` with a ``target_uri`` on
a duplex server (the real app and its SIP stack, served by uvicorn in this process, the toy
pipeline in-process behind a spy that keeps its requests) places a call to a real sipp answering
as the callee; the agent talks with it as with a caller, and ``/hangup`` ends it.

The server allows one session (``max_sessions: 1``) and SIP peers on 127.0.0.1 only, so that a
callee on 127.0.0.2 is outside the allow-list.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from duplex.app_state import AppState
from duplex.media.pcm import ulaw_decode
from duplex.transports.sip.agent import SipAgent
from duplex.transports.sip.rtp import RtpPacket
from harness.server import free_port, write_preset
from tests.operators.conftest import SpyPipeline, served, toy_pipeline

from .peers import UdpPeer, port_is_free, rms, wait_until
from .test_dial_out import callee

pytestmark = pytest.mark.e2e

TIMEOUT = 20.0
INSTRUCTIONS = "You are Dialo, who calls people back for the test."
VOICED = 500  # packet RMS (16-bit) above which the agent is speaking; the toy's tone is ~7000
RTP_PORTS = (43500, 43599)


@dataclass
class Service:
    http: httpx.AsyncClient
    state: AppState
    agent: SipAgent
    pipeline: SpyPipeline

    async def dial(self, body: Any) -> httpx.Response:
        return await self.http.post("/v1/realtime/calls", json=body)

    async def call(self, call_id: str) -> dict[str, Any]:
        answer = await self.http.get(f"/v1/realtime/calls/{call_id}")
        assert answer.status_code == 200, answer.text
        return answer.json()

    async def reaches(self, call_id: str, state: str) -> dict[str, Any]:
        """The call's state as GET reports it, once it is ``state``."""
        async with asyncio.timeout(TIMEOUT):
            while (call := await self.call(call_id))["state"] != state:
                await asyncio.sleep(0.05)  # polled over HTTP, as an app does
        return call

    async def sessions_active(self) -> float:
        text = (await self.http.get("/metrics")).text
        line = next((line for line in text.splitlines()
                     if line.startswith('duplex_sessions_active{transport="sip"}')), None)
        return float(line.split()[-1]) if line else 0.0

    async def nothing_left(self) -> None:
        await wait_until(lambda: len(self.state.registry) == 0 and not self.agent.live
                         and self.state.registry.held == 0)
        assert await self.sessions_active() == 0
        assert all(port_is_free(port) for port in range(RTP_PORTS[0], RTP_PORTS[1], 2))


@pytest.fixture(scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Service]:
    tmp = tmp_path_factory.mktemp("dial-out")
    preset = write_preset(
        tmp / "preset.yaml", pipeline=toy_pipeline(6), pipeline_mode="inproc",
        voices=["default", "bright"], max_sessions=1, sip_port=free_port(),
        rtp_ports=f"{RTP_PORTS[0]}-{RTP_PORTS[1]}", sip_allow=["127.0.0.1/32"])
    async with served(preset, TIMEOUT) as server:
        yield Service(server.http, server.state, server.app.state.sip_agent, server.pipeline)


def voiced(sink: UdpPeer, packets: list[RtpPacket]) -> int:
    """Moves what the sink received into ``packets``; how many carry the agent's voice."""
    for data, _ in sink.drain():
        packet = RtpPacket.parse(data)
        if packet is not None and packet.payload_type == 0:
            packets.append(packet)
    return sum(1 for p in packets if rms(ulaw_decode(p.payload)) > VOICED)


async def test_a_placed_call_is_answered_and_talks_as_configured(service: Service,
                                                                speech_dir: Path) -> None:
    sink = await UdpPeer.open()
    try:
        async with callee("dial_answer.xml", speech_dir, ("rtp_sink", str(sink.port))) as port:
            target = f"sip:bob@127.0.0.1:{port}"
            placed = await service.dial({"target_uri": target, "session": {
                "instructions": INSTRUCTIONS, "audio": {"output": {"voice": "bright"}}}})
            assert placed.status_code == 201, placed.text
            call = placed.json()
            assert call["state"] == "dialing" and call["target_uri"] == target
            assert call["id"].startswith("sip_") and call["direction"] == "outbound"
            assert placed.headers["location"] == f"/v1/realtime/calls/{call['id']}"
            await service.reaches(call["id"], "active")
            assert await service.sessions_active() == 1
            # The callee says something; the agent answers it, as the app configured it.
            packets: list[RtpPacket] = []
            await wait_until(lambda: voiced(sink, packets) >= 25, TIMEOUT)
            request = service.pipeline.requests[-1]
            assert request.owner == call["id"] and request.params["voice"] == "bright"
            assert INSTRUCTIONS in service.pipeline.instructions()[-1]
            hangup = await service.http.post(f"/v1/realtime/calls/{call['id']}/hangup")
            assert hangup.status_code == 200  # a BYE: the callee's scenario ends with its 200
        ended = await service.reaches(call["id"], "ended")
        assert ended["reason"] == "hangup" and ended["sip_status"] == 200
        await service.nothing_left()
    finally:
        sink.close()


async def test_a_busy_callee_fails_the_call_with_486(service: Service, speech_dir: Path) -> None:
    async with callee("dial_busy.xml", speech_dir) as port:
        placed = await service.dial({"target_uri": f"sip:bob@127.0.0.1:{port}"})
        assert placed.status_code == 201, placed.text
        failed = await service.reaches(placed.json()["id"], "failed")
    assert (failed["sip_status"], failed["reason"]) == (486, "Busy Here")
    await service.nothing_left()


async def test_hanging_up_while_it_rings_cancels_the_call(service: Service, speech_dir: Path) -> None:
    async with callee("dial_cancel.xml", speech_dir) as port:  # it requires our CANCEL and ACK
        placed = await service.dial({"target_uri": f"sip:bob@127.0.0.1:{port}"})
        call_id = placed.json()["id"]
        assert (await service.reaches(call_id, "ringing"))["sip_status"] == 183
        # The ringing call holds the only slot.
        second = await service.dial({"target_uri": f"sip:carol@127.0.0.1:{port}"})
        assert second.status_code == 503 and second.json()["error"]["code"] == "too_many_sessions"
        assert (await service.http.post(f"/v1/realtime/calls/{call_id}/hangup")).status_code == 200
        cancelled = await service.reaches(call_id, "cancelled")
    assert cancelled["sip_status"] == 487
    await service.nothing_left()


@pytest.mark.parametrize(("body", "code", "param"), [
    ({"target_uri": "sip:bob@127.0.0.2:PORT"}, "target_not_allowed", "target_uri"),
    ({"target_uri": "sip:bob@127.0.0.1:PORT>\r\nX-Evil: 1"}, "invalid_target_uri", "target_uri"),
    ({"target_uri": "sip:bob@127.0.0.1:PORT?X-Evil=1"}, "invalid_target_uri", "target_uri"),
    ({"target_uri": "sip:bob@localhost:PORT"}, "invalid_target_uri", "target_uri"),
    ({"target_uri": "tel:+14155550123"}, "invalid_target_uri", "target_uri"),
    ({"target_uri": "sip:bob@127.0.0.1:PORT", "session": {"audio": {"output": {"voice": "nobody"}}}},
     "invalid_value", "session.audio.output.voice"),
    ({"target_uri": "sip:bob@127.0.0.1:PORT", "from": "sip:eve@x"}, "invalid_value", "from"),
    ({"session": {}}, "invalid_value", "target_uri"),
])
async def test_refused_requests_send_nothing(service: Service, body: dict[str, Any], code: str,
                                             param: str) -> None:
    watchers = [await UdpPeer.open(), UdpPeer()]
    loop = asyncio.get_running_loop()
    await loop.create_datagram_endpoint(lambda: watchers[1], local_addr=("127.0.0.2", watchers[0].port))
    before = set(service.agent.server.dialling)  # finished calls linger there for a while
    try:
        body = {**body}
        if "target_uri" in body:
            body["target_uri"] = body["target_uri"].replace("PORT", str(watchers[0].port))
        refused = await service.dial(body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == (code, param), error
        await asyncio.sleep(0.6)  # past T1: an INVITE would have been sent, and sent again
        assert all(w.queue.empty() for w in watchers)
        assert service.state.registry.held == 0 and set(service.agent.server.dialling) == before
    finally:
        for watcher in watchers:
            watcher.close()
