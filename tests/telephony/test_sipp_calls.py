"""A real SIP peer (sipp) calling the SipServer in-process: calls, refusals, hold, DTMF.

The offer names the test's own UDP socket (``-key rtp_sink``) as the caller's RTP address, so the
test sees every packet the server sends; sipp plays speech from its media port.
"""

from __future__ import annotations

import asyncio
from itertools import pairwise

import numpy as np
import pytest

from duplex.media.pcm import alaw_decode, ulaw_decode
from duplex.transports.sip.rtp import RtpPacket

from .peers import (
    TIMEOUT,
    Acceptor,
    UdpPeer,
    port_is_free,
    rms,
    rtp_packets,
    sipp,
    telephone_event,
    wait_until,
)

pytestmark = pytest.mark.e2e

DECODERS = {0: ulaw_decode, 8: alaw_decode}


@pytest.mark.parametrize(("scenario", "codec", "pt"), [
    ("call_pcmu.xml", "PCMU", 0), ("call_pcma.xml", "PCMA", 8),
])
async def test_call_both_ways_then_bye(make_server, speech_dir, scenario, codec, pt):
    server, acceptor = await make_server()
    sink = await UdpPeer.open()
    try:
        rc, out = await sipp(scenario, server.port, speech_dir, ("rtp_sink", str(sink.port)))
        assert rc == 0, out
        call = acceptor.calls[0]
        assert await asyncio.wait_for(call.ended, TIMEOUT) == "bye"
        assert call.info.codec == codec and call.info.dtmf
        # The caller's speech arrived decoded, about as long as sipp played it.
        heard = call.inbound()
        assert len(heard) >= 8000 and rms(heard) > 300, (len(heard), rms(heard))
        # Our tone went out in 20 ms packets of the negotiated type, paced, numbered in order.
        packets = rtp_packets(sink.drain())
        assert len(packets) >= 50
        assert {p.payload_type for p, _ in packets} == {pt}
        assert all(len(p.payload) == 160 for p, _ in packets)
        sent = np.concatenate([DECODERS[p.payload_type](p.payload) for p, _ in packets])
        assert rms(sent) > 2000
        seqs = [p.sequence for p, _ in packets]
        assert all((b - a) & 0xFFFF == 1 for a, b in pairwise(seqs))
        stamps = [p.timestamp for p, _ in packets]
        assert all((b - a) & 0xFFFFFFFF == 160 for a, b in pairwise(stamps))
        assert packets[0][0].marker
        span = packets[-1][1] - packets[0][1]
        assert abs(span - 0.02 * (len(packets) - 1)) < 0.2, span
        # Nothing of the call is left.
        assert not server.calls
        assert port_is_free(call.info.local_rtp[1]) and port_is_free(call.info.local_rtp[1] + 1)
    finally:
        sink.close()


async def test_dtmf_then_the_agent_hangs_up(make_server, speech_dir):
    """RFC 4733 digits from a Python RTP source, once each; then our BYE ends sipp's call."""
    server, acceptor = await make_server()
    sink = await UdpPeer.open()
    caller = asyncio.create_task(
        sipp("call_wait_bye.xml", server.port, speech_dir, ("rtp_sink", str(sink.port))))
    try:
        call = await acceptor.next_call()
        rtp = ("127.0.0.1", call.info.local_rtp[1])
        seq, stamp = 1000, 5000
        for digit, event in (("1", 1), ("#", 11)):
            # Start, two continuations, three ends (RFC 4733 §2.5.1.4): one digit.
            for duration, end in ((160, False), (320, False), (480, False), (640, True),
                                  (640, True), (640, True)):
                packet = RtpPacket(101, seq, stamp, 0x1234, telephone_event(event, end, duration),
                                   marker=duration == 160)
                sink.send(packet.serialise(), rtp)
                seq += 1
            stamp += 1600
            assert await asyncio.wait_for(call.events.get(), TIMEOUT) == f"dtmf:{digit}"
        # Some speech afterwards, and garbage on the RTP and RTCP ports: ignored.
        sink.send(b"\x00garbage", rtp)
        sink.send(b"\x81\xc8\x00\x06" + bytes(24), (rtp[0], rtp[1] + 1))  # an RTCP SR
        for i in range(5):
            packet = RtpPacket(0, seq + i, stamp + 160 * i, 0x1234, bytes([0x10]) * 160)
            sink.send(packet.serialise(), rtp)
        await wait_until(lambda: len(call.audio) >= 5)
        assert call.digits == ["1", "#"]
        call.control.hangup()
        rc, out = await asyncio.wait_for(caller, 30)
        assert rc == 0, out
        assert await asyncio.wait_for(call.ended, TIMEOUT) == "hangup"
        assert not server.calls
    finally:
        caller.cancel()
        sink.close()


async def test_hold_and_resume(make_server, speech_dir):
    server, acceptor = await make_server()
    sink = await UdpPeer.open()
    try:
        rc, out = await sipp("call_hold.xml", server.port, speech_dir,
                             ("rtp_sink", str(sink.port)))
        assert rc == 0, out
        call = acceptor.calls[0]
        assert call.holds == [True, False]
        assert await asyncio.wait_for(call.ended, TIMEOUT) == "bye"
        packets = rtp_packets(sink.drain())
        # While held nothing was sent: one gap of about the hold's second, after which the
        # numbering goes on without a hole, the timestamp jumps by the time that passed and the
        # first packet is marked as a talkspurt start.
        gaps = [(b[1] - a[1], i + 1) for i, (a, b) in enumerate(pairwise(packets))]
        gap, after = max(gaps)
        assert 0.7 < gap < 3.0, gap
        before, resumed = packets[after - 1][0], packets[after][0]
        assert (resumed.sequence - before.sequence) & 0xFFFF == 1
        assert abs(((resumed.timestamp - before.timestamp) & 0xFFFFFFFF) - gap * 8000) < 1600
        assert resumed.marker
        assert sorted(g for g, _ in gaps)[-2] < 0.5  # the only hole is the hold
    finally:
        sink.close()


async def test_no_inbound_media_ends_the_call(make_server, speech_dir):
    server, acceptor = await make_server(media_timeout=1.0)
    sink = await UdpPeer.open()
    try:
        rc, out = await sipp("call_wait_bye.xml", server.port, speech_dir,
                             ("rtp_sink", str(sink.port)))
        assert rc == 0, out
        assert await asyncio.wait_for(acceptor.calls[0].ended, TIMEOUT) == "media-timeout"
        assert not server.calls
    finally:
        sink.close()


async def test_over_capacity_gets_503(make_server, speech_dir):
    server, acceptor = await make_server(Acceptor(capacity=1))
    sink = await UdpPeer.open()
    first = asyncio.create_task(
        sipp("call_wait_bye.xml", server.port, speech_dir, ("rtp_sink", str(sink.port))))
    try:
        call = await acceptor.next_call()
        rc, out = await sipp("invite_503.xml", server.port, speech_dir,
                             ("rtp_sink", str(sink.port)))
        assert rc == 0, out
        assert len(server.calls) == 1
        call.control.hangup()
        rc, out = await asyncio.wait_for(first, 30)
        assert rc == 0, out
        assert not server.calls
    finally:
        first.cancel()
        sink.close()


@pytest.mark.parametrize(("scenario", "options"), [
    ("invite_403.xml", {"allow": ["10.0.0.0/8"]}),
    ("invite_no_sdp.xml", {}),
    ("bye_unknown.xml", {}),
])
async def test_refusals(make_server, speech_dir, scenario, options):
    server, acceptor = await make_server(**options)
    rc, out = await sipp(scenario, server.port, speech_dir, ("rtp_sink", "9"))
    assert rc == 0, out
    assert acceptor.offered.empty() and not server.calls
