"""Calls the SIP stack places (duplex/transports/sip/dial.py), to a real sipp as the callee (UAS).

The callee's SDP answer names the test's own UDP socket (``-key rtp_sink``) as its RTP address, so
the test sees every packet the server sends, while sipp plays speech to the server from its media
port: audio both ways, as in test_sipp_calls.py. The end to end call through the API, with the
agent's session, is tests/operators/test_dial_out_api.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from duplex.media.pcm import ulaw_decode
from duplex.transports.sip import CallRefused, InvalidTarget, SipTimers
from duplex.transports.sip.dial import Dialling, TargetNotAllowed, parse_target
from duplex.transports.sip.message import SipMessage, parse
from duplex.transports.sip.transaction import response

from .peers import (
    SCENARIOS,
    TIMEOUT,
    ToneMedia,
    UdpPeer,
    free_port,
    port_is_free,
    rms,
    rtp_packets,
    sdp_offer,
    wait_until,
)

pytestmark = pytest.mark.e2e


@asynccontextmanager
async def callee(scenario: str, cwd: Path, *keys: tuple[str, str]) -> AsyncIterator[int]:
    """sipp answering as ``scenario`` (a UAS) for the block, on the port it yields; when the block
    ends, sipp must have finished its scenario (exit status 0)."""
    port = free_port()
    args = ["sipp", "-sf", str(SCENARIOS / scenario), "-i", "127.0.0.1", "-mi", "127.0.0.1",
            "-p", str(port), "-mp", str(free_port()), "-m", "1", "-nostdin", "-timeout", "20s",
            "-timeout_error", "-trace_err", "-error_file", str(cwd / f"{scenario}.errors.log")]
    for key, value in keys:
        args += ["-key", key, value]
    proc = await asyncio.create_subprocess_exec(
        *args, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "TERM": "dumb"})
    try:
        yield port
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        errors = cwd / f"{scenario}.errors.log"
        text = out.decode(errors="replace")[-3000:]
        if errors.exists():
            text += errors.read_text(errors="replace")[-3000:]
        assert proc.returncode == 0, text
    finally:
        if proc.returncode is None:  # no sipp outlives its test
            proc.kill()
            await proc.wait()


class Progress:
    """The states a Dialling reported, in order, and a way to wait for one."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int | None]] = []

    def __call__(self, dialling: Dialling) -> None:
        self.seen.append((dialling.state, dialling.status))

    async def reached(self, state: str) -> None:
        await wait_until(lambda: any(s == state for s, _ in self.seen))


def answer_with_tone(calls: list[ToneMedia]):
    def answer(info, control) -> ToneMedia:
        media = ToneMedia(info, control)
        calls.append(media)
        return media
    return answer


async def test_an_answered_call_carries_audio_both_ways_until_we_hang_up(make_server, speech_dir):
    server, _ = await make_server()
    sink = await UdpPeer.open()
    calls: list[ToneMedia] = []
    progress = Progress()
    try:
        async with callee("dial_answer.xml", speech_dir, ("rtp_sink", str(sink.port))) as port:
            dialling = await server.dial(f"sip:bob@127.0.0.1:{port}", answer_with_tone(calls),
                                         progress, ring_timeout_s=10)
            await progress.reached("answered")
            assert progress.seen == [("ringing", 180), ("answered", 200)]
            call = calls[0]
            assert call.info.outbound and call.info.to_uri == f"sip:bob@127.0.0.1:{port}"
            assert call.info.codec == "PCMU" and call.info.dtmf
            assert dialling.call is not None and server.calls  # the dialog is the server's now
            # The callee's speech reaches the media object; our tone reaches the callee's socket.
            await wait_until(lambda: len(call.inbound()) >= 8000)
            assert rms(call.inbound()) > 300
            await wait_until(lambda: sink.queue.qsize() >= 50)
            call.control.hangup()  # a BYE: sipp's scenario ends with its 200
        assert await asyncio.wait_for(call.ended, TIMEOUT) == "hangup"
        packets = rtp_packets(sink.drain())
        assert {p.payload_type for p, _ in packets} == {0}
        assert rms(np.concatenate([ulaw_decode(p.payload) for p, _ in packets])) > 2000
        assert not server.calls and port_is_free(call.info.local_rtp[1])
    finally:
        sink.close()


async def test_a_busy_callee_fails_the_call_with_its_status(make_server, speech_dir):
    server, _ = await make_server()
    progress = Progress()
    async with callee("dial_busy.xml", speech_dir) as port:  # sipp requires our ACK of the 486
        dialling = await server.dial(f"sip:bob@127.0.0.1:{port}", answer_with_tone([]), progress,
                                     ring_timeout_s=10)
        rtp_port = dialling._invite.body.decode().split("m=audio ")[1].split()[0]
        await progress.reached("failed")
    assert progress.seen == [("failed", 486)] and dialling.reason == "Busy Here"
    assert not server.calls and port_is_free(int(rtp_port))


@pytest.mark.parametrize(("ring_timeout_s", "outcome"), [(10, "cancelled"), (3, "no_answer")])
async def test_giving_up_before_the_answer_sends_cancel(make_server, speech_dir, ring_timeout_s,
                                                        outcome):
    """The app hangs up while it rings (or nobody answers in time): CANCEL, then the 487's ACK."""
    server, _ = await make_server()
    progress = Progress()
    async with callee("dial_cancel.xml", speech_dir) as port:  # it requires CANCEL and ACK
        dialling = await server.dial(f"sip:bob@127.0.0.1:{port}", answer_with_tone([]), progress,
                                     ring_timeout_s=ring_timeout_s)
        await progress.reached("ringing")
        if outcome == "cancelled":
            dialling.cancel()
        await progress.reached(outcome)
    assert progress.seen == [("ringing", 183), (outcome, 487)]
    assert not server.calls


async def test_a_call_refused_here_after_the_answer_is_hung_up(make_server, speech_dir):
    """No room for the answered call after all: ACK, then a BYE (sipp's scenario needs both)."""
    server, _ = await make_server()
    sink = await UdpPeer.open()
    progress = Progress()

    def refuse(info, control):
        raise CallRefused(503, "Service Unavailable")

    try:
        async with callee("dial_answer.xml", speech_dir, ("rtp_sink", str(sink.port))) as port:
            await server.dial(f"sip:bob@127.0.0.1:{port}", refuse, progress, ring_timeout_s=10)
            await progress.reached("failed")
        assert progress.seen[-1] == ("failed", 503) and not server.calls
    finally:
        sink.close()


@pytest.mark.parametrize("uri", [
    "sip:bob@example.com",  # a name: never looked up
    "sips:bob@127.0.0.1", "tel:+14155550123", "http://127.0.0.1/", "sip:", "sip:bob@",
    "sip:bob@127.0.0.1>\r\nX-Evil: 1", "sip:bob@127.0.0.1\r\n", 'sip:"bob"@127.0.0.1',
    "sip:bob@127.0.0.1?X-Evil=1", "sip:bob@127.0.0.1, sip:eve@127.0.0.1", "sip:a b@127.0.0.1",
    "sip:bob@127.0.0.1;transport=tcp", "sip:bob@127.0.0.1:70000", "sip:bob@999.0.0.1",
    "sip:" + "a" * 1100 + "@127.0.0.1",
])
def test_malformed_targets(uri):
    with pytest.raises(InvalidTarget):
        parse_target(uri)


@pytest.mark.parametrize(("uri", "address"), [
    ("sip:127.0.0.1", ("127.0.0.1", 5060)),
    ("sip:+14155550123@192.0.2.1:5070;user=phone", ("192.0.2.1", 5070)),
    ("sip:bob@[::1]:5062;transport=UDP", ("::1", 5062)),
])
def test_targets(uri, address):
    assert parse_target(uri).address == address


async def test_nothing_is_sent_to_a_target_refused(make_server):
    server, _ = await make_server(allow=["10.0.0.0/8"])
    watcher = await UdpPeer.open()  # where the refused call would go
    try:
        for uri in (f"sip:bob@127.0.0.1:{watcher.port}", f"sip:bob@127.0.0.1:{watcher.port}>x"):
            with pytest.raises(InvalidTarget) as refused:
                await server.dial(uri, answer_with_tone([]), Progress(), ring_timeout_s=1)
            assert isinstance(refused.value, TargetNotAllowed) == uri.endswith(str(watcher.port))
        await asyncio.sleep(0.6)  # past T1: an INVITE would have been sent, and sent again
        assert watcher.queue.empty() and not server.dialling
    finally:
        watcher.close()


# --- a hand-driven callee: what sipp cannot do on cue -------------------------------------------


async def next_request(peer: UdpPeer, *skip: str) -> SipMessage:
    """The next SIP request the callee receives whose method is not in ``skip``."""
    async with asyncio.timeout(TIMEOUT):
        while True:
            msg = parse(await peer.recv())
            if msg.method not in skip:
                return msg


async def test_an_unanswered_invite_is_retransmitted_then_fails_with_408(make_server):
    server, _ = await make_server(timers=SipTimers(t1=0.05, t2=0.2))  # timer B: 3.2 s
    peer = await UdpPeer.open()
    progress = Progress()
    try:
        dialling = await server.dial(f"sip:bob@127.0.0.1:{peer.port}", answer_with_tone([]),
                                     progress, ring_timeout_s=30)
        await progress.reached("failed")
        assert progress.seen == [("failed", 408)]
        received = peer.drain()
        sent = [parse(data) for data, _ in received]
        assert {(m.method, m.branch) for m in sent} == {("INVITE", dialling.branch)}
        # Timer A: 0.05, 0.1, 0.2, ... s apart, doubling past T2 (RFC 3261 §17.1.1.2), until
        # timer B: seven INVITEs in 64*T1 (the seventh is due 50 ms before it); capped at T2,
        # seventeen.
        gaps = [b - a for (_, a), (_, b) in pairwise(received)]
        assert 6 <= len(sent) <= 7 and max(gaps) > 0.7, gaps
        assert not server.calls
    finally:
        peer.close()


async def test_cancel_waits_for_a_provisional_response_and_a_crossing_answer_is_hung_up(make_server):
    """RFC 3261 §9.1: no CANCEL before a provisional response; then a 200 OK that crossed the
    CANCEL is acknowledged and ended with a BYE."""
    server, _ = await make_server(timers=SipTimers(t1=0.1, t2=0.4))
    peer = await UdpPeer.open()
    progress = Progress()
    server_addr = ("127.0.0.1", server.port)
    try:
        dialling = await server.dial(f"sip:bob@127.0.0.1:{peer.port}", answer_with_tone([]),
                                     progress, ring_timeout_s=30)
        invite = parse(await peer.recv())
        dialling.cancel()
        again = parse(await peer.recv())  # the INVITE's retransmission, and no CANCEL before it
        assert again.method == "INVITE" and peer.queue.empty()
        ringing = response(invite, 180, server_addr, to_tag="callee")
        peer.send(ringing.serialise(), server_addr)
        cancel = await next_request(peer, "INVITE")
        assert cancel.method == "CANCEL" and cancel.branch == invite.branch
        assert cancel.cseq == (invite.cseq[0], "CANCEL") and cancel.get("to") == invite.get("to")
        peer.send(response(cancel, 200, server_addr, to_tag="callee").serialise(), server_addr)
        ok = response(invite, 200, server_addr, to_tag="callee", body=sdp_offer(peer.port).encode(),
                      headers=[("contact", f"<sip:bob@127.0.0.1:{peer.port}>")])
        peer.send(ok.serialise(), server_addr)
        ack = await next_request(peer, "CANCEL")
        assert ack.method == "ACK" and ack.branch != invite.branch and ack.to_tag == "callee"
        bye = await next_request(peer, "CANCEL")
        assert bye.method == "BYE" and bye.to_tag == "callee" and bye.uri == f"sip:bob@127.0.0.1:{peer.port}"
        await progress.reached("cancelled")
        assert progress.seen == [("cancelled", 200)]
        peer.send(ok.serialise(), server_addr)  # the 200 OK again: acknowledged again
        assert (await next_request(peer, "CANCEL", "BYE")).method == "ACK"
    finally:
        peer.close()
