"""The aiortc peer of one WebRTC call: SDP checks, ICE policy, inbound audio, events channel.

:class:`CallPeer` answers one client's offer (``POST /v1/realtime/calls``) and then carries the
call's media and events:

- inbound: the client's audio track, decoded by aiortc's decoder on the event loop rather than in
  its decoder thread (:mod:`~duplex.transports.webrtc.inbound`; Opus: 48 kHz stereo s16),
  resampled with PyAV to 16 kHz mono float32 (the VAD's and the model's rate) and handed to the
  listener with its arrival time on the monotonic clock (the decoded frame, after aiortc's jitter
  buffer);
- outbound: an :class:`~duplex.media.paced_track.OutboundAudioTrack` (``peer.outbound``), paced 20 ms
  frames the session fills, pauses and flushes (the call's, lent to each peer it has in turn, or
  the peer's own); when the call negotiated Opus, the sender gets them as Opus packets through an
  :class:`~duplex.media.paced_track.OpusPacketTrack` (encoded on the event loop, no audio-level
  loop), otherwise as frames for aiortc's own encoder;
- the ``oai-events`` data channel the client opens: JSON events in and out; events sent before
  the channel is open are held and sent once it opens (``on_open`` is then called); a client that
  closes that channel while the connection stays up has hung up;
- on presets whose model sees (a :class:`~duplex.media.video_window.VideoWindow` given), the
  client's one video track: aiortc decodes it in its own thread, and each decoded frame is
  offered to the window, which keeps the few the model will read.

The peer owns its ``RTCPeerConnection``, its inbound resampler, reader and watch tasks (and its
outbound track, where it made it) for the length of its connection; :meth:`CallPeer.close`
(hang-up, session end), an ICE/DTLS failure, the client's close or, with ``inbound_timeout_s``, no
inbound audio for that long releases all of it, and the listener hears ``on_closed`` exactly once,
with the reason (:data:`HUNG_UP` and the others below tell the call which ends were the client's
choice). Which ICE servers and host addresses it uses is the server's
:class:`~duplex.transports.webrtc.ice.IcePolicy`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from aiortc import RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.sdp import SessionDescription

from duplex.media.paced_track import OpusPacketTrack, OutboundAudioTrack
from duplex.media.resample import FrameResampler
from duplex.media.video_window import VideoWindow
from duplex.transports.webrtc.ice import IcePolicy
from duplex.transports.webrtc.inbound import decode_on_loop
from duplex.transports.webrtc.lent_track import LentOpusTrack, LentTrack
from duplex.transports.webrtc.sdp import SdpError, plan_answer

EVENTS_CHANNEL = "oai-events"
INBOUND_RATE = 16000
# Events the session sends before the client's channel opens (session.created, ...) wait here.
# A client that never opens the channel is ended by the session's own timeouts; this bound only
# keeps it from holding memory meanwhile.
MAX_PENDING_EVENTS = 256
# Why a peer closed, besides the reasons given to close() (``on_closed``):
FAILED = "failed"  # ICE or DTLS failed (aiortc's connection state)
GONE = "closed"  # the client closed its peer connection (DTLS close_notify, SCTP abort)
HUNG_UP = "events channel closed by the client"  # closed on its own, the connection still up
INBOUND_TIMEOUT = "inbound media timeout"  # no audio from the client for inbound_timeout_s
REJECTED = "rejected"  # an offer that cannot be answered

logger = logging.getLogger(__name__)


class PeerListener(Protocol):
    """What a :class:`CallPeer` reports to its call. Called on the event loop; no blocking."""

    def on_audio(self, samples: np.ndarray, arrival: float) -> None:
        """16 kHz mono float32 audio from the client; ``arrival``: ``time.monotonic()``."""

    def on_message(self, message: str | bytes) -> None:
        """A message received on the events channel (JSON text, not yet parsed)."""

    def on_closed(self, reason: str) -> None:
        """The peer closed: the reason given to :meth:`CallPeer.close`, or one of the module's
        reasons (:data:`REJECTED`, :data:`FAILED`, :data:`GONE`, :data:`HUNG_UP`,
        :data:`INBOUND_TIMEOUT`)."""


class CallPeer:
    """One call's aiortc peer (see module doc)."""

    def __init__(self, call_id: str, policy: IcePolicy, listener: PeerListener,
                 video: VideoWindow | None = None, outbound: OutboundAudioTrack | None = None,
                 inbound_timeout_s: float | None = None) -> None:
        """``outbound``: the track to send (its owner stops it); by default the peer makes one and
        stops it when it closes. ``inbound_timeout_s``: close (:data:`INBOUND_TIMEOUT`) once the
        client sent no audio for that long, counted from the answer (None: never)."""
        self.call_id = call_id
        self.video = video  # where the client's video goes; None: video is refused (port 0)
        self._policy = policy
        self._listener: PeerListener | None = listener  # until close
        self._log = logging.LoggerAdapter(logger, {"session_id": call_id})
        self._pc = RTCPeerConnection(policy.configuration())
        self._owns_outbound = outbound is None
        self.outbound = OutboundAudioTrack() if outbound is None else outbound
        self._channel: RTCDataChannel | None = None
        self._pending: deque[str] = deque(maxlen=MAX_PENDING_EVENTS)
        self.on_open: Callable[[], None] | None = None  # called once the events channel opened
        self.opened = False  # whether the client's events channel ever opened
        self._reader: asyncio.Task[None] | None = None
        self._video_reader: asyncio.Task[None] | None = None
        self._timeout_s = inbound_timeout_s
        self._last_audio = time.monotonic()
        self._watch: asyncio.Task[None] | None = None
        self._closed = False
        self._pc.on("track", self._on_track)
        self._pc.on("datachannel", self._on_datachannel)
        self._pc.on("connectionstatechange", self._on_connection_state)

    @property
    def connection_state(self) -> str:
        return self._pc.connectionState

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def channel_open(self) -> bool:
        """Whether events sent now go out on the client's events channel at once."""
        return not self._closed and self._channel is not None and self._channel.readyState == "open"

    async def answer(self, offer_sdp: str) -> str:
        """Take the client's offer, return the answer SDP (candidates included: no trickle).

        Sections beyond the call's one audio stream and events channel are rejected in the answer
        (port 0) and never reach aiortc, so no track, receiver or frame queue exists for them.
        Raises :class:`SdpError` for an offer that cannot be answered; the peer is then closed.
        """
        try:
            plan = plan_answer(offer_sdp, video=self.video is not None)
            if plan.rejected:
                self._log.info("rejecting offered sections: %s", ", ".join(plan.rejected_kinds))
            offer = RTCSessionDescription(self._policy.filter_candidates(plan.offer), "offer")
            await self._pc.setRemoteDescription(offer)
            # A track the peer does not own is lent (lent_track.py): its sender must not stop it.
            sent = self.outbound if self._owns_outbound else LentTrack(self.outbound)
            sender = self._pc.addTrack(sent)
            self._policy.restrict(self._pc)
            await self._pc.setLocalDescription(await self._pc.createAnswer())
            if _sends_opus(self._pc.localDescription.sdp):
                # Before any frame is sent: the sender starts reading once ICE and DTLS are up.
                opus = OpusPacketTrack if self._owns_outbound else LentOpusTrack
                sender.replaceTrack(opus(self.outbound))
            answer = plan.complete(self._pc.localDescription.sdp)
        except SdpError:
            await self.close(REJECTED)
            raise
        except Exception as exc:  # aiortc's own checks: ValueError, InvalidAccessError, ...
            await self.close(REJECTED)
            raise SdpError(f"cannot answer this offer: {exc}") from exc
        self._log.info("answered offer%s", " with video" if plan.video else "")
        if self._timeout_s is not None:
            self._last_audio = time.monotonic()
            self._watch = asyncio.get_running_loop().create_task(
                self._watch_inbound(self._timeout_s))
        return answer

    def send_event(self, event: dict[str, Any]) -> None:
        """Send a JSON event to the client, now or as soon as the events channel opens."""
        self.send_text(json.dumps(event))

    def send_text(self, message: str) -> None:
        """``send_event`` for an event already serialised."""
        if self.closed:
            return
        if self._channel is not None and self._channel.readyState == "open":
            self._channel.send(message)
            return
        if len(self._pending) == self._pending.maxlen:
            self._log.warning("events channel not open: dropping the oldest held event")
        self._pending.append(message)

    async def close(self, reason: str = "closed") -> None:
        """End the call and release the peer, its track, reader and held events. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        if self._owns_outbound:
            self.outbound.stop()
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()
        if self._reader is not None:
            self._reader.cancel()
        if self._video_reader is not None:
            self._video_reader.cancel()
        if self.video is not None:
            self.video.close()
        await self._pc.close()
        self._log.info("peer closed (%s)", reason)
        # Let go of everything that leads back here or to the call (which owns this peer): the
        # handlers aiortc holds, the cancelled reader (its frames hold the peer), the listener.
        # Left behind, those cycles keep the whole call (its session, its resamplers) alive
        # until Python's cyclic garbage collector runs.
        self._pc.remove_all_listeners()
        if self._channel is not None:
            self._channel.remove_all_listeners()
        self._reader = self._video_reader = self._watch = None
        self.on_open = None
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.on_closed(reason)

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "video" and self.video is not None and self._video_reader is None:
            self._video_reader = asyncio.create_task(self._read_video(track, self.video))
            return
        if track.kind != "audio" or self._reader is not None:
            return
        for receiver in self._pc.getReceivers():
            if receiver.track is track:
                decode_on_loop(receiver, self._log)
        self._reader = asyncio.create_task(self._read_inbound(track))

    async def _read_inbound(self, track: MediaStreamTrack) -> None:
        resampler = FrameResampler(INBOUND_RATE)
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                self._log.info("inbound audio track ended")
                return
            arrival = self._last_audio = time.monotonic()
            samples = resampler.push(frame)
            if len(samples) and self._listener is not None:
                self._listener.on_audio(samples, arrival)

    async def _read_video(self, track: MediaStreamTrack, window: VideoWindow) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                self._log.info("inbound video track ended")
                window.close()
                return
            window.offer(frame, time.monotonic())

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != EVENTS_CHANNEL:
            self._log.info("ignoring data channel %r", channel.label)
            return
        self._channel = channel
        self.opened = True
        channel.on("message", self._on_message)
        channel.on("close", self._on_channel_close)
        # The server learns of a client's channel once it is open, so held events can go now.
        while self._pending:
            channel.send(self._pending.popleft())
        if self.on_open is not None:
            self.on_open()

    async def _on_channel_close(self) -> None:
        # The channel closes on its own (a stream reset) only when the client closed it; when the
        # whole connection goes (the client's close, a failure, ours), the SCTP association is
        # closed first, and the connection's end says why.
        sctp = self._pc.sctp
        if not self._closed and sctp is not None and sctp.state == "connected":
            await self.close(HUNG_UP)

    def _on_message(self, message: str | bytes) -> None:
        if self._listener is not None:
            self._listener.on_message(message)

    async def _watch_inbound(self, timeout_s: float) -> None:
        """Close the peer once the client sent no audio for ``timeout_s``: a client that vanished
        (a network gone) is noticed long before ICE's consent checks give up (~30 s)."""
        while True:
            idle = time.monotonic() - self._last_audio
            if idle >= timeout_s:
                self._log.info("no inbound audio for %.1f s", idle)
                await self.close(INBOUND_TIMEOUT)
                return
            await asyncio.sleep(timeout_s - idle)

    async def _on_connection_state(self) -> None:
        state = self._pc.connectionState
        self._log.info("connection %s", state)
        if state in (FAILED, GONE):
            await self.close(state)


def _sends_opus(answer_sdp: str) -> bool:
    """Whether the answer's audio section sends Opus (aiortc's sender uses its first codec)."""
    for media in SessionDescription.parse(answer_sdp).media:
        if media.kind == "audio" and media.rtp.codecs:
            return media.rtp.codecs[0].mimeType.lower() == "audio/opus"
    return False
