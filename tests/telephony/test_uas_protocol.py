"""The SipServer's protocol edges, driven by a hand-written UAC over loopback UDP.

These are the cases sipp cannot produce on cue: CANCEL while the acceptor decides, a caller that
never ACKs, retransmitted requests, malformed and garbage datagrams, close() with live calls.
"""

from __future__ import annotations

import asyncio
from itertools import pairwise

from duplex.transports.sip import SipTimers
from duplex.transports.sip.rtp import RtpPacket
from duplex.transports.sip.sdp import parse_offer
from duplex.transports.sip.transaction import response

from .peers import (
    TIMEOUT,
    Acceptor,
    RawUac,
    ToneMedia,
    UdpPeer,
    port_is_free,
    rtp_packets,
    sdp_offer,
    wait_until,
)

FAST = SipTimers(t1=0.02, t2=0.16)  # 64*T1 = 1.28 s


async def uac_for(server) -> RawUac:
    uac = await RawUac.open()
    uac.server = ("127.0.0.1", server.port)
    return uac


async def test_options_and_unknown_methods(make_server):
    server, _ = await make_server()
    uac = await uac_for(server)
    try:
        uac.request("OPTIONS")
        ok = await uac.response(200)
        assert "INVITE" in ok.get_all("allow") and ok.get("accept") == "application/sdp"
        assert ok.to_tag and ok.call_id == uac.call_id
        uac.request("NEWMETHOD")
        refused = await uac.response()
        assert refused.status == 405 and "BYE" in refused.get_all("allow")
        uac.request("OPTIONS", headers=("Require: 100rel, timer",))
        bad_extension = await uac.response()
        assert bad_extension.status == 420
        assert bad_extension.get_all("unsupported") == ["100rel", "timer"]
        uac.request("CANCEL")
        assert (await uac.response()).status == 481
    finally:
        uac.close()


async def test_offers_it_cannot_take(make_server):
    server, acceptor = await make_server()
    uac = await uac_for(server)
    try:
        uac.request("INVITE", body=sdp_offer(4000, formats="18 101"))  # G.729 only
        assert (await uac.response()).status == 488
        uac.request("ACK", call_id=uac.call_id, branch=uac.branch)
        uac.request("OPTIONS")  # answered after the ACK was handled (loopback keeps order)
        assert (await uac.response(200)).status == 200
        assert not any(tx.retransmit and tx.retransmit.running
                       for tx in server._transactions.values())  # the ACK stopped the 488s
        uac.request("INVITE", body=sdp_offer(4000), content_type="text/plain")
        unsupported = await uac.response()
        assert unsupported.status == 415 and unsupported.get("accept") == "application/sdp"
        uac.request("INVITE", body=sdp_offer(4000), headers=("Content-Encoding: gzip",))
        assert (await uac.response()).status == 415
        assert acceptor.offered.empty() and not server.calls
    finally:
        uac.close()


async def test_video_is_rejected_audio_goes_on(make_server):
    server, acceptor = await make_server()
    uac = await uac_for(server)
    try:
        offer = sdp_offer(4000, formats="8 0") + "m=video 4002 RTP/AVP 96\r\na=rtpmap:96 VP8/90000\r\n"
        uac.request("INVITE", body=offer)
        assert (await uac.response(100)).status == 100
        ok = await uac.response(200)
        assert ok.status == 200
        lines = parse_offer(ok.body.decode())
        assert [(m.kind, m.port == 0, m.formats[0]) for m in lines] == [
            ("audio", False, "8"), ("video", True, "96")]
        assert ok.get("contact") and ok.to_tag
        uac.request("ACK", call_id=uac.call_id, to_tag=ok.to_tag)
        call = await acceptor.next_call()
        assert call.info.codec == "PCMA" and not call.info.dtmf
        uac.request("BYE", call_id=uac.call_id, cseq=2, to_tag=ok.to_tag)
        assert (await uac.response(200)).status == 200
        assert await asyncio.wait_for(call.ended, TIMEOUT) == "bye"
    finally:
        uac.close()


async def test_cancel_while_the_acceptor_decides(make_server):
    gate = asyncio.Event()
    server, acceptor = await make_server(Acceptor(gate=gate))
    uac = await uac_for(server)
    try:
        uac.request("INVITE", body=sdp_offer(4000))
        invite_branch = uac.branch
        assert (await uac.response(100)).status == 100
        await asyncio.wait_for(acceptor.offered.get(), TIMEOUT)
        uac.request("CANCEL", call_id=uac.call_id, branch=invite_branch)
        answers = {(await uac.response()).status, (await uac.response()).status}
        assert answers == {200, 487}
        uac.request("ACK", call_id=uac.call_id, branch=invite_branch)
        # The acceptor's decision is cancelled with the call (handler.py): it holds nothing.
        await wait_until(lambda: acceptor.cancelled == 1)
        assert acceptor.accepted.empty() and not acceptor.calls
        assert not server.calls
    finally:
        uac.close()


async def test_no_ack_retransmits_then_hangs_up(make_server):
    server, acceptor = await make_server(timers=FAST)
    uac = await uac_for(server)
    try:
        uac.request("INVITE", body=sdp_offer(4000))
        assert (await uac.response(100)).status == 100
        # Timer G: the 200 again and again, then (timer H) the call ends with our BYE.
        oks = 0
        async with asyncio.timeout(TIMEOUT):
            while (msg := await uac.response()).status == 200:
                oks += 1
        assert oks >= 4
        assert msg.method == "BYE" and msg.call_id == uac.call_id
        uac.send(response(msg, 200, ("127.0.0.1", uac.port)).serialise(), uac.server)
        call = acceptor.calls[0]
        assert await asyncio.wait_for(call.ended, TIMEOUT) == "no-ack"
        assert not server.calls
    finally:
        uac.close()


async def test_retransmitted_requests_get_the_same_answer(make_server):
    server, acceptor = await make_server()
    uac = await uac_for(server)
    try:
        text = uac.request("INVITE", body=sdp_offer(4000))
        ok = await uac.response(200)
        uac.send(text.encode(), uac.server)  # the INVITE again (same branch)
        again = await uac.response(200)
        assert again.to_tag == ok.to_tag and again.body == ok.body
        assert len(acceptor.calls) == 1
        # The same dialog-creating INVITE on a new branch is a merged request.
        uac.request("INVITE", call_id=uac.call_id, body=sdp_offer(4000))
        assert (await uac.response(482)).status == 482
        uac.request("ACK", call_id=uac.call_id, to_tag=ok.to_tag)
        bye = uac.request("BYE", call_id=uac.call_id, cseq=2, to_tag=ok.to_tag)
        assert (await uac.response(200)).status == 200
        uac.send(bye.encode(), uac.server)
        assert (await uac.response(200)).status == 200  # from the transaction, not a 481
        assert await asyncio.wait_for(acceptor.calls[0].ended, TIMEOUT) == "bye"
    finally:
        uac.close()


async def test_malformed_and_garbage(make_server):
    server, acceptor = await make_server()
    uac = await uac_for(server)
    try:
        text = uac.request("INVITE", body=sdp_offer(4000))
        dialog = uac.call_id
        ok = await uac.response(200)
        uac.request("ACK", call_id=dialog, to_tag=ok.to_tag)
        call = await acceptor.next_call()
        for junk in (b"\x00\xff" * 50, b"INVITE\r\n\r\n", b"SIP/2.0 200\r\n\r\n", b"\r\n\r\n",
                     text.replace("Content-Length: ", "Content-Length: 9").encode()):
            uac.send(junk, uac.server)
            uac.send(junk, ("127.0.0.1", call.info.local_rtp[1]))
        bad = text.replace(dialog, "x1").replace("SIP/2.0\r\n", "SIP/3.0\r\n", 1)
        uac.send(bad.encode(), uac.server)
        # The Content-Length lie got its 400, the version its 505, the rest was dropped.
        statuses = set()
        async with asyncio.timeout(TIMEOUT):
            while not {400, 505} <= statuses:
                statuses.add((await uac.response()).status)
        uac.request("OPTIONS")
        assert (await uac.response(200)).status == 200
        assert server.calls and not call.ended.done()
        closing = asyncio.create_task(server.close())
        # close(): the live call gets our BYE, and close() returns once it is answered.
        bye = await uac.response()
        assert bye.method == "BYE" and bye.call_id == dialog and bye.from_tag == ok.to_tag
        uac.send(response(bye, 200, ("127.0.0.1", uac.port)).serialise(), uac.server)
        await asyncio.wait_for(closing, 1.0)
        assert call.ended.result() == "server-closed"
        assert port_is_free(call.info.local_rtp[1]) and port_is_free(server.port)
    finally:
        uac.close()


async def test_rtp_reordered_lost_and_ssrc_change(make_server):
    server, acceptor = await make_server()
    uac = await uac_for(server)
    source = await UdpPeer.open()
    try:
        uac.request("INVITE", body=sdp_offer(source.port))
        ok = await uac.response(200)
        uac.request("ACK", call_id=uac.call_id, to_tag=ok.to_tag)
        call = await acceptor.next_call()
        rtp = ("127.0.0.1", call.info.local_rtp[1])
        def send(seq: int, ssrc: int = 1, pt: int = 0, level: int = 0x80) -> None:
            source.send(RtpPacket(pt, seq, seq * 160, ssrc, bytes([level]) * 160).serialise(), rtp)

        for seq in (1, 3, 2, 4, 13, 5, 9, 10, 11):  # 2<->3 swapped, 6-8 lost, 13 comfort noise
            send(seq, pt=13 if seq == 13 else 0)
        send(500, ssrc=2)  # a new stream
        await wait_until(lambda: len(call.audio) >= 12)
        assert len(call.audio) == 12  # 1-5, three concealed, 9-11, then the new SSRC's first
        assert all(len(frame) == 160 for frame in call.audio)
        assert [int(abs(frame).max()) > 0 for frame in call.audio[5:8]] == [False] * 3
        uac.request("BYE", call_id=uac.call_id, cseq=2, to_tag=ok.to_tag)
        assert (await uac.response(200)).status == 200
    finally:
        source.close()
        uac.close()


async def test_talkspurts_are_marked_and_the_timestamp_runs_on(make_server):
    server, acceptor = await make_server()
    uac = await uac_for(server)
    sink = await UdpPeer.open()
    try:
        uac.request("INVITE", body=sdp_offer(sink.port))
        ok = await uac.response(200)
        uac.request("ACK", call_id=uac.call_id, to_tag=ok.to_tag)
        call = await acceptor.next_call()
        call.speaking = False  # silence packets, unmarked
        await wait_until(lambda: sink.queue.qsize() >= 8)
        call.speaking = True
        await wait_until(lambda: sink.queue.qsize() >= 14)
        packets = [p for p, _ in rtp_packets(sink.drain())]
        silence = bytes([0xFF]) * 160  # μ-law zero
        quiet = next(i for i, p in enumerate(packets) if p.payload == silence)
        talk = next(i for i, p in enumerate(packets) if i > quiet and p.payload != silence)
        assert packets[0].marker and packets[talk].marker
        assert not any(p.marker for p in packets[1:talk] + packets[talk + 1:])
        assert all((b.timestamp - a.timestamp) & 0xFFFFFFFF == 160
                   for a, b in pairwise(packets))
        uac.request("BYE", call_id=uac.call_id, cseq=2, to_tag=ok.to_tag)
        assert (await uac.response(200)).status == 200
    finally:
        sink.close()
        uac.close()


async def test_reinvites_without_offer_and_with_a_bad_one(make_server):
    server, acceptor = await make_server()
    uac = await uac_for(server)
    try:
        uac.request("INVITE", body=sdp_offer(4000))
        dialog = uac.call_id
        ok = await uac.response(200)
        uac.request("ACK", call_id=dialog, to_tag=ok.to_tag)
        call = await acceptor.next_call()
        # No offer: ours comes in the 200, the answer (holding the call) in the ACK.
        uac.request("INVITE", call_id=dialog, cseq=2, to_tag=ok.to_tag)
        offer = await uac.response(200)
        assert parse_offer(offer.body.decode())[0].port == call.info.local_rtp[1]
        uac.request("ACK", call_id=dialog, cseq=2, to_tag=ok.to_tag,
                    body=sdp_offer(4000, extra="a=sendonly\r\n"))
        assert await asyncio.wait_for(call.events.get(), TIMEOUT) == "hold:True"
        # An offer without a codec we speak: 488, and the call goes on as it was.
        uac.request("INVITE", call_id=dialog, cseq=3, to_tag=ok.to_tag,
                    body=sdp_offer(4000, formats="18"))
        assert (await uac.response(488)).status == 488
        uac.request("ACK", call_id=dialog, cseq=3, to_tag=ok.to_tag, branch=uac.branch)
        # An older CSeq is out of order (RFC 3261 §12.2.2).
        uac.request("INVITE", call_id=dialog, cseq=2, to_tag=ok.to_tag, body=sdp_offer(4000))
        assert (await uac.response(500)).status == 500
        assert server.calls and not call.ended.done() and call.holds == [True]
        uac.request("BYE", call_id=dialog, cseq=4, to_tag=ok.to_tag)
        assert (await uac.response(200)).status == 200
    finally:
        uac.close()


async def test_a_failing_acceptor_leaves_nothing_behind(make_server):
    async def broken(info, control):
        raise RuntimeError("no session for you")

    server, _ = await make_server(broken)
    uac = await uac_for(server)
    try:
        uac.request("INVITE", body=sdp_offer(4000))
        assert (await uac.response(500)).status == 500
        assert not server.calls and port_is_free(42000)
    finally:
        uac.close()


async def test_a_plain_function_can_accept_and_hang_up_at_once(make_server):
    """A synchronous acceptor works; hanging up before the answer declines the call (603)."""
    made: list[ToneMedia] = []

    def accept(info, control):
        made.append(ToneMedia(info, control))
        if len(made) == 2:
            control.hangup()
        return made[-1]

    server, _ = await make_server(accept)
    uac = await uac_for(server)
    try:
        uac.request("INVITE", body=sdp_offer(4000))
        ok = await uac.response(200)
        uac.request("ACK", call_id=uac.call_id, to_tag=ok.to_tag)
        uac.request("BYE", call_id=uac.call_id, cseq=2, to_tag=ok.to_tag)
        assert (await uac.response(200)).status == 200
        assert await asyncio.wait_for(made[0].ended, TIMEOUT) == "bye"
        uac.request("INVITE", body=sdp_offer(4000))
        assert (await uac.response(603)).status == 603
        assert await asyncio.wait_for(made[1].ended, TIMEOUT) == "hangup"
        assert not server.calls
    finally:
        uac.close()


async def test_hold_suspends_the_inbound_media_timeout(make_server):
    server, acceptor = await make_server(media_timeout=0.5)
    uac = await uac_for(server)
    try:
        uac.request("INVITE", body=sdp_offer(4000, extra="a=inactive\r\n"))
        dialog = uac.call_id
        ok = await uac.response(200)
        assert "a=inactive" in ok.body.decode()
        uac.request("ACK", call_id=dialog, to_tag=ok.to_tag)
        call = await acceptor.next_call()
        assert await asyncio.wait_for(call.events.get(), TIMEOUT) == "hold:True"
        # Held from the start and silent for three timeouts: the call must stay up (this
        # waits on purpose: the property under test is that time passing changes nothing).
        await asyncio.sleep(1.5)
        assert not call.ended.done()
        uac.request("INVITE", call_id=dialog, cseq=2, to_tag=ok.to_tag, body=sdp_offer(4000))
        assert (await uac.response(200)).status == 200
        uac.request("ACK", call_id=dialog, cseq=2, to_tag=ok.to_tag)
        assert await asyncio.wait_for(call.events.get(), TIMEOUT) == "hold:False"
        assert await asyncio.wait_for(call.ended, TIMEOUT) == "media-timeout"
        bye = await uac.response()
        assert bye.method == "BYE"
        uac.send(response(bye, 200, ("127.0.0.1", uac.port)).serialise(), uac.server)
        await wait_until(lambda: not server._requests)  # our BYE's transaction is complete
    finally:
        uac.close()
