"""One call's RTP media: the UDP sockets, the receive path and the paced sender.

:class:`RtpSession` binds an even RTP port from the configured range and the RTCP port above it
(RTCP is read and ignored: we neither need reports nor send them). Inbound packets go through
the reorder buffer, then by payload type to G.711 decoding (``on_audio``), the DTMF decoder
(``on_dtmf``) or nowhere (comfort noise, RTCP multiplexed on the RTP port, unknown types).
What the reorder buffer releases (a lost packet's concealment included) is charged to a
:class:`~duplex.media.inbound_budget.RealTimeBudget` first: a peer sending faster than real time
has the excess dropped before it is decoded.
The sender pulls a frame from ``next_frame`` every 20 ms on the monotonic clock, on a deadline
schedule like duplex/outbound.py, and keeps the RTP timestamp running through silence and hold.
No RTP for ``media_timeout`` seconds while the peer is meant to send calls ``on_timeout``.

The session belongs to one call (call.py), which creates it with ``open`` and ends it with
``close``; its sockets and tasks live exactly that long.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from duplex.media.inbound_budget import RealTimeBudget

from .handler import FRAME_SAMPLES, CallMedia
from .jitter import ReorderBuffer
from .rtp import COMFORT_NOISE_PT, RTCP_MUX_PTS, DtmfDecoder, RtpPacket
from .sdp import Negotiated

FRAME_SECONDS = FRAME_SAMPLES / 8000
# Behind schedule by more than this, restart the schedule rather than burst the missed packets
# (the peer's jitter buffer would drop a burst anyway); as in duplex/outbound.py.
MAX_LAG_SECONDS = 0.2


def _g711():
    # Imported when a call starts, not with the package: the stack's signalling and tests do
    # not need duplex's media layer (G.711 tables built at its import).
    from duplex.media import pcm

    return {"PCMU": (pcm.ulaw_encode, pcm.ulaw_decode), "PCMA": (pcm.alaw_encode, pcm.alaw_decode)}


@dataclass
class PortPool:
    """Even RTP ports of ``[low, high]`` (RTCP takes port+1); one pool per server."""

    low: int
    high: int
    _used: set[int] = field(default_factory=set, init=False)
    _next: int = field(default=0, init=False)

    def candidates(self) -> list[int]:
        """Free even ports, starting after the last one handed out (so a port is not reused
        at once, while stray packets of the call before may still arrive)."""
        evens = [p for p in range(self.low + self.low % 2, self.high, 2) if p not in self._used]
        start = next((i for i, p in enumerate(evens) if p >= self._next), 0)
        return evens[start:] + evens[:start]

    def take(self, port: int) -> None:
        self._used.add(port)
        self._next = port + 2

    def give_back(self, port: int) -> None:
        self._used.discard(port)


class _Datagrams(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes, tuple], None] | None) -> None:
        self._on_datagram = on_datagram

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        if self._on_datagram is not None:
            self._on_datagram(data, addr)


class RtpSession:
    """See module doc. Build it with :meth:`open`."""

    def __init__(self, host: str, port: int, pool: PortPool, allowed: Callable[[str], bool],
                 media_timeout: float, log: logging.LoggerAdapter) -> None:
        self.host, self.port = host, port
        self._pool = pool
        self._allowed = allowed
        self._media_timeout = media_timeout
        self.log = log
        self._rtp: asyncio.DatagramTransport | None = None
        self._rtcp: asyncio.DatagramTransport | None = None
        self._tasks: list[asyncio.Task] = []
        self._media: CallMedia | None = None
        self._neg: Negotiated | None = None
        self._on_timeout: Callable[[], None] = lambda: None
        # G.711 for the negotiated codec, set by start() and update().
        self._encode: Callable[[np.ndarray], bytes]
        self._decode: Callable[[bytes], np.ndarray]
        self._silence = b""  # one encoded frame of silence
        # Receive state.
        self._ssrc_in: int | None = None
        self._buffer = ReorderBuffer()
        self._dtmf = DtmfDecoder()
        self._inbound_frame = FRAME_SAMPLES  # samples per inbound packet (the peer's ptime)
        self._budget = RealTimeBudget("sip", log)
        self._last_rx = time.monotonic()
        # Send state: random initial values (RFC 3550 §5.1), the timestamp advancing 160 a tick.
        self._ssrc_out = random.getrandbits(32)
        self._seq = random.getrandbits(15)  # lower half: far from the wrap for a while
        self._timestamp = random.getrandbits(31)
        self._talking = False  # the last tick sent speech: the next speech is no talkspurt start
        self.packets_sent = 0
        self.packets_received = 0

    @classmethod
    async def open(cls, host: str, pool: PortPool, allowed: Callable[[str], bool],
                   media_timeout: float, log: logging.LoggerAdapter) -> RtpSession:
        """Bind a free port pair of ``pool``; raises OSError when none is left."""
        loop = asyncio.get_running_loop()
        for port in pool.candidates():
            session = cls(host, port, pool, allowed, media_timeout, log)
            try:
                session._rtp, _ = await loop.create_datagram_endpoint(
                    lambda s=session: _Datagrams(s._received), local_addr=(host, port))
            except OSError:
                continue
            try:
                session._rtcp, _ = await loop.create_datagram_endpoint(
                    lambda: _Datagrams(None), local_addr=(host, port + 1))
            except OSError:
                session._rtp.close()
                continue
            pool.take(port)
            return session
        raise OSError("no free RTP port in the configured range")

    def start(self, media: CallMedia, neg: Negotiated, on_timeout: Callable[[], None]) -> None:
        """Begin sending and receiving for ``media`` with what the offer/answer settled."""
        self._media, self._neg, self._on_timeout = media, neg, on_timeout
        self._encode, self._decode = _g711()[neg.codec]
        self._silence = self._encode(np.zeros(FRAME_SAMPLES, dtype=np.int16))
        self._last_rx = time.monotonic()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._send_loop()), loop.create_task(self._watchdog())]

    def update(self, neg: Negotiated) -> None:
        """A re-INVITE's new offer/answer (hold, resume, a new address or codec)."""
        assert self._neg is not None
        if neg.codec != self._neg.codec:
            self._encode, self._decode = _g711()[neg.codec]
            self._silence = self._encode(np.zeros(FRAME_SAMPLES, dtype=np.int16))
        self._last_rx = time.monotonic()  # the timeout starts afresh after any change
        self._neg = neg

    def close(self) -> None:
        """Stop the tasks, release the sockets and the port. Idempotent."""
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        for transport in (self._rtp, self._rtcp):
            if transport is not None:
                transport.close()
        if self._rtp is not None:
            self._pool.give_back(self.port)
        self._rtp = self._rtcp = None
        self._media = None

    # Receive path -------------------------------------------------------------------------

    def _received(self, data: bytes, addr: tuple) -> None:
        neg, media = self._neg, self._media
        if neg is None or media is None or not self._allowed(addr[0]):
            return
        packet = RtpPacket.parse(data)
        if packet is None or (packet.marker and packet.payload_type in RTCP_MUX_PTS):
            return
        arrival = time.monotonic()
        self._last_rx = arrival
        self.packets_received += 1
        if neg.held:
            return  # music on hold is not the caller speaking
        if packet.ssrc != self._ssrc_in:
            if self._ssrc_in is not None:
                self.log.info("inbound RTP SSRC changed to %08x", packet.ssrc)
            self._ssrc_in = packet.ssrc
            self._buffer = ReorderBuffer()
        for item in self._buffer.push(packet):
            self._deliver(item, neg, media, arrival)

    def _deliver(self, packet: RtpPacket | None, neg: Negotiated, media: CallMedia,
                 arrival: float) -> None:
        if not self._budget.admit(self._seconds(packet, neg)):
            return
        try:
            if packet is None:  # lost: conceal with silence so the timeline keeps its length
                media.on_audio(np.zeros(self._inbound_frame, dtype=np.int16), arrival)
            elif packet.payload_type == neg.payload_type and packet.payload:
                self._inbound_frame = len(packet.payload)  # G.711: one byte a sample
                media.on_audio(self._decode(packet.payload), arrival)
            elif packet.payload_type == neg.dtmf_payload_type:
                digit = self._dtmf.push(packet)
                if digit is not None:
                    self.log.info("DTMF %s", digit)
                    media.on_dtmf(digit)
            elif packet.payload_type != COMFORT_NOISE_PT:
                self.log.debug("ignoring RTP payload type %d", packet.payload_type)
        except Exception:
            self.log.exception("call media failed on inbound audio")

    def _seconds(self, packet: RtpPacket | None, neg: Negotiated) -> float:
        """The media time a released packet (None: a lost one, to conceal) stands for."""
        if packet is None:
            return self._inbound_frame / 8000
        if packet.payload_type == neg.payload_type:
            return len(packet.payload) / 8000  # G.711: one byte a sample
        # DTMF, comfort noise, unknown types: a frame each, so that a flood of them is bounded too.
        return FRAME_SECONDS

    async def _watchdog(self) -> None:
        while True:
            assert self._neg is not None
            if self._neg.held or not self._neg.expects_media:
                self._last_rx = time.monotonic()  # suspended: count from the resume
            left = self._last_rx + self._media_timeout - time.monotonic()
            if left <= 0:
                self.log.info("no RTP for %.1f s: ending the call", self._media_timeout)
                self._on_timeout()
                return
            await asyncio.sleep(min(left, 1.0))

    # Send path ----------------------------------------------------------------------------

    async def _send_loop(self) -> None:
        start, ticks = time.monotonic(), 0
        while True:
            deadline = start + ticks * FRAME_SECONDS
            now = time.monotonic()
            if now - deadline > MAX_LAG_SECONDS:
                self.log.warning("outbound RTP %.0f ms behind schedule: restarting it",
                                  (now - deadline) * 1000)
                start, ticks, deadline = now, 0, now
            if deadline > now:
                await asyncio.sleep(deadline - now)
            self._tick()
            ticks += 1

    def _tick(self) -> None:
        neg, media, transport = self._neg, self._media, self._rtp
        timestamp = self._timestamp
        self._timestamp = (self._timestamp + FRAME_SAMPLES) & 0xFFFFFFFF
        if neg is None or media is None or transport is None:
            return
        if not neg.may_send or neg.held or not self._may_send_to(neg.remote):
            self._talking = False  # after a quiet spell, speech starts a talkspurt
            return
        try:
            frame = media.next_frame()
        except Exception:
            self.log.exception("call media failed on next_frame")
            frame = None
        if frame is None:
            payload, marker = self._silence, False
            self._talking = False
        else:
            pcm = np.zeros(FRAME_SAMPLES, dtype=np.int16)
            pcm[: min(len(frame), FRAME_SAMPLES)] = frame[:FRAME_SAMPLES]
            payload, marker = self._encode(pcm), not self._talking
            self._talking = True
        packet = RtpPacket(neg.payload_type, self._seq, timestamp, self._ssrc_out, payload,
                           marker or self.packets_sent == 0)
        self._seq = (self._seq + 1) & 0xFFFF
        self.packets_sent += 1
        transport.sendto(packet.serialise(), neg.remote)

    def _may_send_to(self, remote: tuple[str, int]) -> bool:
        # The offer names where RTP goes; never spray audio at an address we would not talk to.
        return remote[1] != 0 and remote[0] != "0.0.0.0" and self._allowed(remote[0])
