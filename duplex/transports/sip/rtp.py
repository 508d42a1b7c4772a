"""RTP packets (RFC 3550 §5.1) and RFC 4733 telephone events.

``RtpPacket.parse`` accepts version-2 packets with any CSRC count, header extension and padding,
and returns None for anything else (garbage on the port is ignored, never an error).
``DtmfDecoder`` turns a stream of telephone-event packets into digits, one per event.

Packets are plain values; a ``DtmfDecoder`` belongs to one call's receive path and lives as long
as that call's media.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass

HEADER = struct.Struct("!BBHII")
COMFORT_NOISE_PT = 13  # RFC 3389
# RTCP packet types 200-204 read, in the RTP header layout, as marker set and PT 72-76: a peer
# multiplexing RTCP on the RTP port (RFC 5761) sends those.
RTCP_MUX_PTS = range(72, 77)
# RFC 4733 §3.2 event codes 0-15.
DTMF_DIGITS = "0123456789*#ABCD"


@dataclass(frozen=True)
class RtpPacket:
    payload_type: int
    sequence: int
    timestamp: int
    ssrc: int
    payload: bytes
    marker: bool = False

    @classmethod
    def parse(cls, data: bytes) -> RtpPacket | None:
        if len(data) < HEADER.size:
            return None
        first, second, sequence, timestamp, ssrc = HEADER.unpack_from(data)
        if first >> 6 != 2:
            return None
        offset = HEADER.size + 4 * (first & 0x0F)
        if first & 0x10:  # header extension: 4 bytes of profile/length, then length words
            if len(data) < offset + 4:
                return None
            (words,) = struct.unpack_from("!H", data, offset + 2)
            offset += 4 + 4 * words
        end = len(data)
        if first & 0x20:  # padding: the last byte counts the padding bytes, itself included
            end -= data[-1]
        if offset > end or (first & 0x20 and data[-1] == 0):
            return None
        return cls(second & 0x7F, sequence, timestamp, ssrc, bytes(data[offset:end]),
                   bool(second & 0x80))

    def serialise(self) -> bytes:
        return HEADER.pack(0x80, (0x80 if self.marker else 0) | self.payload_type,
                           self.sequence, self.timestamp, self.ssrc) + self.payload


@dataclass(frozen=True)
class TelephoneEvent:
    """An RFC 4733 §2.3 payload: event code, end bit, volume, duration in timestamp units."""

    event: int
    end: bool
    volume: int
    duration: int

    @classmethod
    def parse(cls, payload: bytes) -> TelephoneEvent | None:
        if len(payload) < 4:
            return None
        event, flags, duration = struct.unpack_from("!BBH", payload)
        return cls(event, bool(flags & 0x80), flags & 0x3F, duration)

    def serialise(self) -> bytes:
        return struct.pack("!BBH", self.event, (0x80 if self.end else 0) | self.volume,
                           self.duration)


class DtmfDecoder:
    """One digit per telephone event.

    An event is identified by its RTP timestamp, which stays the same for all its packets (RFC
    4733 §2.5.1.2), and is reported when its first end packet arrives; the end packet is sent
    three times and the retransmissions (and stragglers of the event) are recognised by that
    timestamp. Events outside 0-15 (flash, tones) are ignored.
    """

    def __init__(self) -> None:
        self._done: deque[tuple[int, int]] = deque(maxlen=16)  # (ssrc, timestamp) reported

    def push(self, packet: RtpPacket) -> str | None:
        event = TelephoneEvent.parse(packet.payload)
        if event is None or not event.end or event.event >= len(DTMF_DIGITS):
            return None
        key = (packet.ssrc, packet.timestamp)
        if key in self._done:
            return None
        self._done.append(key)
        return DTMF_DIGITS[event.event]
