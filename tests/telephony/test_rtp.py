"""RTP packets, the reorder buffer and RFC 4733 DTMF decoding."""

from __future__ import annotations

import struct

import pytest

from duplex.transports.sip.jitter import ReorderBuffer
from duplex.transports.sip.rtp import DtmfDecoder, RtpPacket, TelephoneEvent


def test_packet_round_trip():
    packet = RtpPacket(8, 65535, 2**32 - 1, 0xDEADBEEF, b"\xd5" * 160, marker=True)
    assert RtpPacket.parse(packet.serialise()) == packet


def test_csrc_extension_and_padding_are_skipped():
    header = struct.pack("!BBHII", 0x80 | 0x20 | 0x10 | 2, 0, 7, 160, 9)
    csrcs = struct.pack("!II", 1, 2)
    extension = struct.pack("!HH", 0xBEDE, 1) + b"\x00" * 4
    data = header + csrcs + extension + b"abc" + b"\x00\x00\x03"
    packet = RtpPacket.parse(data)
    assert packet is not None and packet.payload == b"abc" and packet.sequence == 7


@pytest.mark.parametrize("data", [
    b"", b"\x80\x00", b"\x40" + bytes(20),  # short; version 1
    struct.pack("!BBHII", 0x8F, 0, 1, 1, 1),  # 15 CSRCs announced, none there
    struct.pack("!BBHII", 0x90, 0, 1, 1, 1) + b"\x00\x00",  # a cut extension header
    struct.pack("!BBHII", 0xA0, 0, 1, 1, 1) + b"\x00",  # padding count 0
    struct.pack("!BBHII", 0xA0, 0, 1, 1, 1) + b"\x40",  # more padding than packet
])
def test_garbage_is_not_a_packet(data):
    assert RtpPacket.parse(data) is None


def seqs(items):
    return [None if p is None else p.sequence for p in items]


def pkt(seq: int) -> RtpPacket:
    return RtpPacket(0, seq & 0xFFFF, seq * 160, 1, b"")


def test_in_order_packets_pass_straight_through():
    buffer = ReorderBuffer()
    assert [seqs(buffer.push(pkt(s))) for s in (10, 11, 12)] == [[10], [11], [12]]


def test_reordering_within_depth_is_repaired():
    buffer = ReorderBuffer(depth=3)
    out = []
    for s in (1, 3, 2, 5, 4, 6):
        out += seqs(buffer.push(pkt(s)))
    assert out == [1, 2, 3, 4, 5, 6]


def test_loss_is_declared_once_depth_packets_wait():
    buffer = ReorderBuffer(depth=3)
    out = []
    for s in (1, 4, 5):
        out += seqs(buffer.push(pkt(s)))
    assert out == [1]
    out += seqs(buffer.push(pkt(6)))
    assert out == [1, None, None, 4, 5, 6] and buffer.lost == 2
    assert buffer.push(pkt(2)) == []  # too late: already concealed
    assert buffer.push(pkt(6)) == []  # a duplicate


def test_sequence_wraps_and_restarts():
    buffer = ReorderBuffer()
    out = []
    for s in (65534, 65535, 0, 1):
        out += seqs(buffer.push(pkt(s)))
    assert out == [65534, 65535, 0, 1]
    assert seqs(buffer.push(pkt(30000))) == [30000]  # a jump: the sender restarted
    assert seqs(buffer.push(pkt(29000))) == [29000]  # and back, far: again


def event(ts: int, code: int, end: bool, duration: int, ssrc: int = 5) -> RtpPacket:
    payload = TelephoneEvent(code, end, 10, duration).serialise()
    return RtpPacket(101, 0, ts, ssrc, payload)


def test_dtmf_once_per_event():
    decoder = DtmfDecoder()
    digits = []
    stream = [event(100, 5, False, 160), event(100, 5, False, 320), event(100, 5, True, 480),
              event(100, 5, True, 480), event(100, 5, True, 480),
              event(900, 11, True, 400),  # start packets lost: the end still counts
              event(900, 11, True, 400), event(1700, 5, False, 160), event(1700, 5, True, 320),
              event(2500, 16, True, 320),  # flash: not a digit
              event(100, 5, True, 480, ssrc=6)]  # another stream's event at the same timestamp
    for packet in stream:
        digit = decoder.push(packet)
        if digit:
            digits.append(digit)
    assert digits == ["5", "#", "5", "5"]


def test_short_event_payload_is_ignored():
    assert DtmfDecoder().push(RtpPacket(101, 0, 0, 1, b"\x01")) is None
