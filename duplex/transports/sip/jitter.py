"""A small reordering jitter buffer for inbound RTP.

In-order packets pass straight through (no added latency on a clean network). A packet that
arrives ahead of a gap waits; once ``depth`` packets wait, the missing ones are declared lost
(``None`` in the output, for the receiver to conceal) and the waiting ones are released in order.
Late packets (behind what was already released) and duplicates are dropped. A jump of more than
``RESYNC`` sequence numbers either way means the sender restarted its numbering: the buffer
starts over from that packet.

One buffer per inbound stream (SSRC) of one call; the receiver replaces it when the SSRC changes.
"""

from __future__ import annotations

from .rtp import RtpPacket

RESYNC = 100  # 2 s of 20 ms packets


class ReorderBuffer:
    def __init__(self, depth: int = 3) -> None:
        self.depth = depth
        self._expected: int | None = None  # the next sequence number to release
        self._waiting: dict[int, RtpPacket] = {}
        self.lost = 0  # packets declared lost so far

    def push(self, packet: RtpPacket) -> list[RtpPacket | None]:
        """Add one packet; return what is now releasable, in order, ``None`` for each loss."""
        if self._expected is None:
            self._expected = packet.sequence
        ahead = (packet.sequence - self._expected) & 0xFFFF
        if ahead >= 0x8000:  # behind the release point
            if 0x10000 - ahead <= RESYNC:
                return []  # late or duplicate: already released or concealed
            self._restart(packet.sequence)
        elif ahead > RESYNC:
            self._restart(packet.sequence)
        self._waiting.setdefault(packet.sequence, packet)
        out = self._drain()
        while len(self._waiting) >= self.depth:
            # Skip the gap up to the oldest waiting packet.
            assert self._expected is not None
            oldest = min(self._waiting, key=lambda seq: (seq - self._expected) & 0xFFFF)
            skipped = (oldest - self._expected) & 0xFFFF
            out.extend([None] * skipped)
            self.lost += skipped
            self._expected = oldest
            out.extend(self._drain())
        return out

    def _drain(self) -> list[RtpPacket | None]:
        out: list[RtpPacket | None] = []
        while self._expected in self._waiting:
            out.append(self._waiting.pop(self._expected))
            self._expected = (self._expected + 1) & 0xFFFF
        return out

    def _restart(self, sequence: int) -> None:
        self._waiting.clear()
        self._expected = sequence
