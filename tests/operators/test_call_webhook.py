"""The incoming-call webhook, end to end: sipp calls a duplex server (the real app and its SIP
stack, served by uvicorn in this process, the toy pipeline in-process behind a spy that keeps its
requests); the server POSTs ``realtime.call.incoming`` to a real webhook receiver on loopback,
which checks the signature with the ``openai`` package's own verifier; the test then decides over
real HTTP with the call API (``/accept``, ``/reject``, ``/hangup``), as an app does.

The server allows one session (``max_sessions: 1``), so a call that rings holds the only slot.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from duplex.app_state import AppState
from duplex.media.pcm import ulaw_decode
from duplex.media.recording import file_stem
from duplex.transports.sip.rtp import RtpPacket
from harness.mic import ScriptedMic
from harness.peers import ClientPeer
from harness.server import free_port, write_preset
from tests.operators.conftest import SpyPipeline, served, toy_pipeline
from tests.telephony.peers import SCENARIOS, UdpPeer, rms, sipp, wait_until

pytestmark = pytest.mark.e2e

SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
DECISION_S = 2.0  # the server's call_decision_timeout_s
TIMEOUT = 20.0
INSTRUCTIONS = "You are Ringo, who answers the phone for the test."
QUESTION = "What is the weather like tomorrow?"
TARGET = "sip:desk@transfer.example;user=phone"  # webhook_transfer.xml checks its REFER names it
VOICED = 500  # packet RMS (16-bit) above which the agent is speaking; the toy's tone is ~7000
VERIFIER = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1").webhooks


@dataclass
class Receiver:
    """The app's webhook endpoint: each delivery's signature checked (the ``openai`` package's
    ``verify_signature``), answered ``status``, and its event queued for the test."""

    status: int = 200
    events: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    deliveries: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    forged: int = 0  # deliveries whose signature did not verify
    ignored: set[str] = field(default_factory=set)  # calls whose events the test does not want
    # Run inside the handler, before it answers (an app that decides there), given the call id.
    during: Callable[[str], Awaitable[None]] | None = None

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {name.lower(): value for name, value in request.headers.items()}
        try:
            VERIFIER.verify_signature(body, headers, secret=SECRET)
        except openai.InvalidWebhookSignatureError:
            self.forged += 1
            return web.Response(status=400, text="bad signature")
        self.deliveries.append((headers, body))
        event = json.loads(body)
        if self.during is not None:
            await self.during(event["data"]["call_id"])
        if event["data"]["call_id"] not in self.ignored:
            self.events.put_nowait(event)
        return web.Response(status=self.status)

    async def next_call(self) -> str:
        """The call id of the next incoming call the webhook was told of."""
        event = await asyncio.wait_for(self.events.get(), TIMEOUT)
        assert event["type"] == "realtime.call.incoming"
        return event["data"]["call_id"]


@dataclass
class Service:
    http: httpx.AsyncClient
    sip_port: int
    state: AppState
    app: Any
    pipeline: SpyPipeline
    receiver: Receiver
    speech: Path  # sipp's folder: its speech files and scenarios
    recordings: Path

    async def decide(self, call_id: str, verb: str, body: Any = None) -> httpx.Response:
        return await self.http.post(f"/v1/realtime/calls/{call_id}/{verb}", json=body)

    def idle(self) -> bool:
        """No call rings and no session is live."""
        return len(self.state.registry) == 0 and len(self.app.state.ringing_calls) == 0 \
            and self.state.registry.held == 0


def say_ulaw(folder: Path, text: str) -> None:
    """``question.ulaw`` in ``folder``, what sipp's callers say: ``text`` (espeak-ng, sox)."""
    raw = folder / "question.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(raw), text], check=True)
    subprocess.run(["sox", str(raw), "-r", "8000", "-c", "1", "-t", "ul", str(folder / "question.ulaw")],
                   check=True)


@asynccontextmanager
async def receiving(receiver: Receiver) -> AsyncIterator[str]:
    """``receiver`` served on loopback for the block (aiohttp); the webhook's URL."""
    webhook_app = web.Application()
    webhook_app.router.add_post("/calls", receiver.handle)
    runner = web.AppRunner(webhook_app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/calls"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@pytest.fixture(scope="module")
def speech_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sipp's folder: the caller's question as question.ulaw."""
    tmp = tmp_path_factory.mktemp("call-webhook")
    say_ulaw(tmp, QUESTION)
    return tmp


@pytest.fixture(scope="module")
async def service(speech_dir: Path) -> AsyncIterator[Service]:
    tmp = speech_dir
    receiver = Receiver()
    sip_port = free_port()
    recordings = tmp / "calls"
    recordings.mkdir()
    async with receiving(receiver) as webhook_url:
        preset = write_preset(
            tmp / "preset.yaml", pipeline=toy_pipeline(6), pipeline_mode="inproc",
            voices=["default", "bright"], max_sessions=1, sip_port=sip_port, rtp_ports="43300-43399",
            call_webhook=webhook_url, call_webhook_secret=SECRET,
            call_decision_timeout_s=DECISION_S, record_dir=str(recordings))
        async with served(preset, TIMEOUT) as server:
            yield Service(server.http, sip_port, server.state, server.app, server.pipeline, receiver,
                          tmp, recordings)


def refused(service: Service, status: int, rings: bool) -> Path:
    """webhook_refused.xml for a caller that must get ``status``, after a 180 when ``rings``."""
    text = (SCENARIOS / "webhook_refused.xml").read_text()
    path = service.speech / f"refused_{status}_{rings}.xml"
    path.write_text(text.replace("STATUS", str(status)).replace("RINGS", "false" if rings else "true"))
    return path


@asynccontextmanager
async def calling(service: Service, scenario: str | Path,
                  options: tuple[str, ...] = ()) -> AsyncIterator[UdpPeer]:
    """sipp calls the server for the block, its RTP address in the offer the socket yielded; when
    the block ends, sipp must finish its scenario (exit status 0)."""
    sink = await UdpPeer.open()
    caller = asyncio.create_task(sipp(scenario, service.sip_port, service.speech,
                                      ("rtp_sink", str(sink.port)), options=options))
    try:
        yield sink
        rc, out = await asyncio.wait_for(caller, TIMEOUT)
        assert rc == 0, out
    finally:
        caller.cancel()
        sink.close()


def voiced_packets(sink: UdpPeer, packets: list[RtpPacket]) -> int:
    """Moves what the sink received into ``packets``; how many of them carry the agent's voice."""
    for data, _ in sink.drain():
        packet = RtpPacket.parse(data)
        if packet is not None and packet.payload_type == 0:
            packets.append(packet)
    return sum(1 for p in packets if rms(ulaw_decode(p.payload)) > VOICED)


async def test_an_accepted_call_rings_then_talks_as_the_app_configured_it(service: Service) -> None:
    async with calling(service, "webhook_answered.xml") as sink:
        event = await asyncio.wait_for(service.receiver.events.get(), TIMEOUT)
        # OpenAI's event, with the INVITE's headers but not its credentials.
        assert event["object"] == "event" and event["type"] == "realtime.call.incoming"
        assert event["id"].startswith("evt_") and isinstance(event["created_at"], int)
        call_id = event["data"]["call_id"]
        headers = {h["name"]: h["value"] for h in event["data"]["sip_headers"]}
        assert call_id == f"sip_{headers['Call-ID']}"
        assert headers["X-Account"] == "4711" and "sipp" in headers["From"]
        assert headers["CSeq"] == "1 INVITE"
        assert "Authorization" not in headers and "0123456789abcdef" not in json.dumps(event)
        # A config the server cannot take is refused, naming the field; the call keeps ringing.
        bad = await service.decide(call_id, "accept", {"audio": {"output": {"voice": "nobody"}}})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "session.audio.output.voice"
        ok = await service.decide(call_id, "accept", {
            "type": "realtime", "instructions": INSTRUCTIONS, "audio": {"output": {"voice": "bright"}}})
        assert ok.status_code == 200, ok.text
        again = await service.decide(call_id, "accept", {"instructions": "another"})
        assert again.status_code == 409 and again.json()["error"]["code"] == "call_already_accepted"
        assert (await service.decide(call_id, "reject")).status_code == 409
        # The agent answers the caller's question, in the voice and with the instructions accepted.
        packets: list[RtpPacket] = []
        await wait_until(lambda: voiced_packets(sink, packets) >= 25, TIMEOUT)
        request = service.pipeline.requests[-1]
        assert request.owner == call_id and request.params["voice"] == "bright"
        assert INSTRUCTIONS in service.pipeline.instructions()[-1]
        # /hangup ends a SIP call too: the caller gets a BYE.
        assert (await service.decide(call_id, "hangup")).status_code == 200
    await wait_until(service.idle)
    assert service.receiver.forged == 0


@pytest.mark.parametrize(("body", "status"), [({"status_code": 486}, 486), (None, 603)])
async def test_a_rejected_call_gets_the_status_the_app_chose(service: Service, body: Any,
                                                            status: int) -> None:
    async with calling(service, refused(service, status, rings=True)):
        call_id = await service.receiver.next_call()
        answer = await service.decide(call_id, "reject", body)
        assert answer.status_code == 200, answer.text
    await wait_until(service.idle)
    assert (await service.decide(call_id, "accept", {})).status_code == 404


async def test_no_decision_in_time_gets_480(service: Service) -> None:
    loop = asyncio.get_running_loop()
    async with calling(service, refused(service, 480, rings=True)):
        call_id = await service.receiver.next_call()
        told = loop.time()
    assert loop.time() - told >= DECISION_S - 0.2  # the app had its whole deadline
    assert service.idle()
    late = await service.decide(call_id, "accept", {})
    assert late.status_code == 404 and late.json()["error"]["code"] == "call_not_found"


async def test_a_failing_webhook_refuses_the_call_with_503(service: Service) -> None:
    service.receiver.status = 500
    try:
        async with calling(service, refused(service, 503, rings=True)):
            pass
    finally:
        service.receiver.status = 200
    call_id = await service.receiver.next_call()  # it was told, and answered 500
    assert service.idle()
    assert (await service.decide(call_id, "accept", {})).status_code == 404


async def test_a_decision_inside_the_webhook_wins_over_its_failed_answer(service: Service) -> None:
    """An app that rejects from inside its webhook handler, then answers that POST with 500."""
    decided: list[int] = []

    async def reject_at_once(call_id: str) -> None:
        decided.append((await service.decide(call_id, "reject", {"status_code": 486})).status_code)

    service.receiver.status, service.receiver.during = 500, reject_at_once
    try:
        async with calling(service, refused(service, 486, rings=True)):
            await service.receiver.next_call()
    finally:
        service.receiver.status, service.receiver.during = 200, None
    assert decided == [200] and service.idle()


async def test_cancel_while_ringing_leaves_nothing_and_frees_the_slot(service: Service) -> None:
    sip_call_id = f"cancelled-{secrets.token_hex(4)}"
    call_id = f"sip_{sip_call_id}"
    service.receiver.ignored.add(call_id)  # its webhook may be cut off on the way, or arrive
    async with calling(service, "webhook_cancel.xml", options=("-cid_str", sip_call_id)):
        pass
    assert service.idle()
    for verb in ("accept", "reject", "hangup"):
        gone = await service.decide(call_id, verb, {} if verb == "accept" else None)
        assert gone.status_code == 404, (verb, gone.text)
    # The one slot is free: the next call rings and the app is asked about it.
    async with calling(service, refused(service, 486, rings=True)):
        next_id = await service.receiver.next_call()
        assert next_id != call_id
        assert (await service.decide(next_id, "reject", {"status_code": 486})).status_code == 200


async def held(service: Service) -> float:
    """The ``duplex_sessions_held`` gauge of SIP calls (the gauge must be there)."""
    text = (await service.http.get("/metrics")).text
    return float(next(line for line in text.splitlines()
                      if line.startswith('duplex_sessions_held{transport="sip"}')).split()[-1])


async def test_a_ringing_call_holds_a_slot(service: Service) -> None:
    async with calling(service, refused(service, 486, rings=True)):
        call_id = await service.receiver.next_call()
        assert await held(service) == 1
        # max_sessions is 1 and the first call rings: the second is refused at once, unasked,
        # and so is a WebRTC call: the slot is the ringing call's, whatever the transport.
        async with calling(service, refused(service, 503, rings=False)):
            pass
        assert service.receiver.events.empty()
        peer = ClientPeer(ScriptedMic())
        try:
            offer = await service.http.post("/v1/realtime/calls", content=await peer.offer(),
                                            headers={"Content-Type": "application/sdp"})
        finally:
            await peer.close()
        assert offer.status_code == 503 and offer.json()["error"]["code"] == "too_many_sessions", offer.text
        assert (await service.decide(call_id, "reject", {"status_code": 486})).status_code == 200
    await wait_until(service.idle)
    assert await held(service) == 0


async def test_unknown_calls_and_bad_statuses(service: Service) -> None:
    for verb in ("accept", "reject", "hangup", "refer"):
        body = {"accept": {}, "refer": {"target_uri": TARGET}}.get(verb)
        answer = await service.decide("sip_nobody", verb, body)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "call_not_found"
    for status in (200, 399, 700, "busy"):
        answer = await service.decide("sip_nobody", "reject", {"status_code": status})
        assert answer.status_code == 400, (status, answer.text)


async def test_a_forged_or_altered_delivery_does_not_verify(service: Service) -> None:
    """What the receiver took verifies; the same body altered, or signed with another key, not."""
    assert service.receiver.deliveries, "run with the tests above"
    headers, body = service.receiver.deliveries[0]
    VERIFIER.verify_signature(body, headers, secret=SECRET)
    event = json.loads(body)
    event["data"]["call_id"] = "sip_someone-else"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        VERIFIER.verify_signature(json.dumps(event), headers, secret=SECRET)
    other = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    with pytest.raises(openai.InvalidWebhookSignatureError):
        VERIFIER.verify_signature(body, headers, secret=other)
    ids = {h["webhook-id"] for h, _ in service.receiver.deliveries}
    assert len(ids) == len(service.receiver.deliveries)  # one id per delivery
    assert all(h["webhook-signature"].startswith("v1,") for h, _ in service.receiver.deliveries)


async def test_refer_transfers_the_call_and_reports_its_progress(service: Service) -> None:
    """The caller (sipp) takes the REFER, reports its call to the target in NOTIFYs, and gets the
    BYE after the 200 OK one; the session's server events (its recording's log) tell the story."""
    async with calling(service, "webhook_transfer.xml"):
        call_id = await service.receiver.next_call()
        ringing = await service.decide(call_id, "refer", {"target_uri": TARGET})
        assert ringing.status_code == 409, ringing.text  # only an answered call is transferred
        assert (await service.decide(call_id, "accept", {})).status_code == 200
        for bad in ("http://desk.example", "sip:desk@x>\r\nX-Evil: 1", "sip:a b@x", "sip:"):
            refused = await service.decide(call_id, "refer", {"target_uri": bad})
            assert refused.status_code == 400, (bad, refused.text)
        assert (await service.decide(call_id, "refer", {"target_uri": TARGET})).status_code == 200
    await wait_until(service.idle)
    lines, transfer = transfer_events(service, call_id)
    assert [(e["type"], e["status"]) for e in transfer] == [
        ("call.transfer.progress", 202), ("call.transfer.progress", 100),
        ("call.transfer.progress", 200), ("call.transfer.completed", 200)]
    assert transfer[0]["call_id"] == call_id and transfer[0]["target_uri"] == TARGET
    assert transfer[0]["reason"] == "Accepted"
    assert lines[-1]["kind"] == "end" and "transferred" in lines[-1]["reason"]
    assert (await service.decide(call_id, "refer", {"target_uri": TARGET})).status_code == 404


async def test_a_refused_transfer_is_reported_and_the_call_goes_on(
        service: Service, caplog: pytest.LogCaptureFixture) -> None:
    async with calling(service, "webhook_transfer_refused.xml"):
        call_id = await service.receiver.next_call()
        assert (await service.decide(call_id, "accept", {})).status_code == 200
        assert (await service.decide(call_id, "refer", {"target_uri": TARGET})).status_code == 200
        await wait_until(lambda: any("603 Decline (failed)" in r.getMessage() for r in caplog.records))
        # The caller is still with the agent, and may be transferred again.
        assert service.state.registry.get(call_id) is not None
        assert (await service.decide(call_id, "hangup")).status_code == 200
    await wait_until(service.idle)
    lines, transfer = transfer_events(service, call_id)
    assert [(e["type"], e["status"], e["reason"]) for e in transfer] == [
        ("call.transfer.progress", 603, "Decline"), ("call.transfer.failed", 603, "Decline")]
    assert "hangup" in lines[-1]["reason"]


def transfer_events(service: Service, call_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The call's recorded log lines, and the transfer events among them."""
    path = service.recordings / f"{file_stem(call_id)}.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines, [line["event"] for line in lines if line["kind"] == "server"
                   and line["event"]["type"].startswith("call.transfer.")]
