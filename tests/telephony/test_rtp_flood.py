"""RTP faster than real time: the excess is dropped before it is decoded, and counted.

A caller that sends twenty seconds of audio in a blink (two seconds at a time: what a loopback
socket's receive buffer holds) gets through what the call's real-time budget holds
(duplex/media/inbound_budget.py); the rest is dropped and shows in ``duplex_inbound_audio_dropped_seconds_total{transport="sip"}``,
second for second. A call whose packets stay within the budget loses nothing. In process, with the
hand-written UAC of test_uas_protocol.py and a loopback RTP source.
"""

from __future__ import annotations

from prometheus_client import REGISTRY

from duplex.media.inbound_budget import BURST_S
from duplex.transports.sip.rtp import RtpPacket

from .peers import Acceptor, RawUac, ToneMedia, UdpPeer, sdp_offer, wait_until

FRAME = 160  # samples of a 20 ms μ-law packet
RATE = 8000
ROUNDS = 10


def dropped_s() -> float:
    value = REGISTRY.get_sample_value("duplex_inbound_audio_dropped_seconds_total", {"transport": "sip"})
    assert value is not None, "no duplex_inbound_audio_dropped_seconds_total{transport=\"sip\"}"
    return value


async def call(server, acceptor: Acceptor) -> tuple[RawUac, UdpPeer, ToneMedia]:
    """An answered call and the RTP source that speaks for its caller."""
    uac = await RawUac.open()
    uac.server = ("127.0.0.1", server.port)
    source = await UdpPeer.open()
    uac.request("INVITE", body=sdp_offer(source.port))
    ok = await uac.response(200)
    uac.request("ACK", call_id=uac.call_id, to_tag=ok.to_tag)
    return uac, source, await acceptor.next_call()


def send(source: UdpPeer, media: ToneMedia, seconds: float, ssrc: int, first: int = 0) -> int:
    """``seconds`` of μ-law packets at once, numbered from ``first``; returns their samples."""
    rtp = ("127.0.0.1", media.info.local_rtp[1])
    packets = int(seconds * RATE / FRAME)
    for seq in range(first, first + packets):
        source.send(RtpPacket(0, seq, seq * FRAME, ssrc, b"\x80" * FRAME).serialise(), rtp)
    return packets * FRAME


def counted(media: ToneMedia, dropped_before: float) -> int:
    """Samples the call took or dropped so far."""
    return len(media.inbound()) + round((dropped_s() - dropped_before) * RATE)


async def test_rtp_faster_than_real_time_has_its_excess_dropped(make_server) -> None:
    server, acceptor = await make_server()
    flood_uac, flood, flooded = await call(server, acceptor)
    calm_uac, calm, normal = await call(server, acceptor)
    try:
        before = dropped_s()
        sent = 0
        for _ in range(ROUNDS):
            sent += send(flood, flooded, BURST_S, ssrc=1, first=sent // FRAME)
            await wait_until(lambda total=sent: counted(flooded, before) >= total)
        received = len(flooded.inbound())
        assert counted(flooded, before) == sent
        # What passed is the burst, and what refilled while the packets arrived: far from all.
        assert BURST_S * RATE <= received < sent / 2

        # Another call, within its own budget: nothing lost, nothing counted.
        before = dropped_s()
        sent = send(calm, normal, BURST_S / 2, ssrc=2)
        await wait_until(lambda: len(normal.inbound()) >= sent)
        assert len(normal.inbound()) == sent and dropped_s() == before
    finally:
        for peer in (flood_uac, flood, calm_uac, calm):
            peer.close()
