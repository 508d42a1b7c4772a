"""The aiortc peer of one WebRTC call: SDP checks, ICE policy, inbound audio, events channel.

:class:`CallPeer` answers one client's offer (``POST /v1/realtime/calls``) and then carries the
call's media and events:

- inbound: the client's audio track, decoded by aiortc's decoder on the event loop rather than in
  its decoder thread (:mod:`~duplex.transports.webrtc.inbound`; Opus: 48 kHz stereo s16),
  resampled with PyAV to 16 kHz mono float32 (the VAD's and the model's rate) and handed to the
  listener with its arrival time on the monotonic clock (the decoded frame, after aiortc's jitter
  buffer);
- outbound: an :class:`~duplex.media.paced_track.OutboundAudioTrack` (``peer.outbound``), paced 20 ms
  frames the session fills, pauses and flushes; when the call negotiated Opus, the sender gets them
  as Opus packets through an :class:`~duplex.media.paced_track.OpusPacketTrack` (encoded on the
  event loop, no audio-level loop), otherwise as frames for aiortc's own encoder;
- the ``oai-events`` data channel the client opens: JSON events in and out; events sent before
  the channel is open are held and sent once it opens;
- on presets whose model sees (a :class:`~duplex.media.video_window.VideoWindow` given), the
  client's one video track: aiortc decodes it in its own thread, and each decoded frame is
  offered to the window, which keeps the few the model will read.

The peer owns its ``RTCPeerConnection``, its inbound resampler, reader task and outbound track for
the length of the call; :meth:`CallPeer.close` (hang-up, session end) or an ICE/DTLS failure
releases all of it, and the listener hears ``on_closed`` exactly once. Which ICE servers and host
addresses it uses is the server's :class:`~duplex.transports.webrtc.ice.IcePolicy`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
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
from duplex.transports.webrtc.sdp import SdpError, plan_answer

EVENTS_CHANNEL = "oai-events"
INBOUND_RATE = 16000
# Events the session sends before the client's channel opens (session.created, ...) wait here.
# A client that never opens the channel is ended by the session's own timeouts; this bound only
# keeps it from holding memory meanwhile.
MAX_PENDING_EVENTS = 256

logger = logging.getLogger(__name__)


class PeerListener(Protocol):
    """What a :class:`CallPeer` reports to its call. Called on the event loop; no blocking."""

    def on_audio(self, samples: np.ndarray, arrival: float) -> None:
        """16 kHz mono float32 audio from the client; ``arrival``: ``time.monotonic()``."""

    def on_message(self, message: str | bytes) -> None:
        """A message received on the events channel (JSON text, not yet parsed)."""

    def on_closed(self, reason: str) -> None:
        """The call ended: the reason given to :meth:`CallPeer.close`, "rejected" (a bad offer)
        or "failed" (ICE or DTLS)."""


class CallPeer:
    """One call's aiortc peer (see module doc)."""

    def __init__(self, call_id: str, policy: IcePolicy, listener: PeerListener,
                 video: VideoWindow | None = None) -> None:
        self.call_id = call_id
        self.video = video  # where the client's video goes; None: video is refused (port 0)
        self._policy = policy
        self._listener: PeerListener | None = listener  # until close
        self._log = logging.LoggerAdapter(logger, {"session_id": call_id})
        self._pc = RTCPeerConnection(policy.configuration())
        self.outbound = OutboundAudioTrack()
        self._channel: RTCDataChannel | None = None
        self._pending: deque[str] = deque(maxlen=MAX_PENDING_EVENTS)
        self._reader: asyncio.Task[None] | None = None
        self._video_reader: asyncio.Task[None] | None = None
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
            sender = self._pc.addTrack(self.outbound)
            self._policy.restrict(self._pc)
            await self._pc.setLocalDescription(await self._pc.createAnswer())
            if _sends_opus(self._pc.localDescription.sdp):
                # Before any frame is sent: the sender starts reading once ICE and DTLS are up.
                sender.replaceTrack(OpusPacketTrack(self.outbound))
            answer = plan.complete(self._pc.localDescription.sdp)
        except SdpError:
            await self.close("rejected")
            raise
        except Exception as exc:  # aiortc's own checks: ValueError, InvalidAccessError, ...
            await self.close("rejected")
            raise SdpError(f"cannot answer this offer: {exc}") from exc
        self._log.info("answered offer%s", " with video" if plan.video else "")
        return answer

    def send_event(self, event: dict[str, Any]) -> None:
        """Send a JSON event to the client, now or as soon as the events channel opens."""
        if self.closed:
            return
        message = json.dumps(event)
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
        self.outbound.stop()
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
        self._reader = self._video_reader = None
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
            arrival = time.monotonic()
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
        channel.on("message", self._on_message)
        # The server learns of a client's channel once it is open, so held events can go now.
        while self._pending:
            channel.send(self._pending.popleft())

    def _on_message(self, message: str | bytes) -> None:
        if self._listener is not None:
            self._listener.on_message(message)

    async def _on_connection_state(self) -> None:
        state = self._pc.connectionState
        self._log.info("connection %s", state)
        if state in ("failed", "closed"):
            await self.close(state)


def _sends_opus(answer_sdp: str) -> bool:
    """Whether the answer's audio section sends Opus (aiortc's sender uses its first codec)."""
    for media in SessionDescription.parse(answer_sdp).media:
        if media.kind == "audio" and media.rtp.codecs:
            return media.rtp.codecs[0].mimeType.lower() == "audio/opus"
    return False
