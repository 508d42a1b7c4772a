"""One WebRTC call: a Session served by one CallPeer (media, events channel) at a time, through a
SessionBinding, and kept for a while when that peer is lost.

The call owns its session, its binding, its outbound track and its current peer. The track lives
as long as the session: the session's :class:`~duplex.media.playout.PacedPlayout` plays into it,
and each peer the call has in turn sends it (lent: ``lent_track.py``). A peer lives as long as its
peer connection.

Events leave through the current peer's events channel once it is open; until then (the client's
channel not yet open, or no peer at all) they wait in the call's :class:`Outbox` and go out, in
order, as soon as a channel opens.

Resumption (docs/resume.md, :mod:`duplex.transports.resumption`): each ``session.created`` carries a
new resume token. When the peer is lost without a hang-up (ICE or DTLS failed, the client closed
its peer connection, as a page reload does, or no audio came for ``inbound_media_timeout_s``), the
session is *detached*: the response in flight is cut to the audio the peer sent (the paced playout
counted it), its slot is kept, and events (there is no audio event on WebRTC) wait in the outbox,
until a new offer presents the token (``resume``: a new peer, a new ``session.created``, then what
was held) or the grace period ends (``expire``). A resume that finds the old peer still up (a
network hand-over that nothing noticed yet) lets it go first, as a drop.

These end the session for good: the call API's hang-up (``DELETE`` or ``/hangup``), the client
closing its events channel while its connection stays up (:data:`~.peer.HUNG_UP`), every close the
server makes itself (the agent hanging up, a flood, shutdown), the loss of a peer whose events
channel never opened (its client never got a token), and any loss where resumption is off. The
binding then releases the session and its registry slot, exactly once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import numpy as np

from duplex.media.paced_track import OutboundAudioTrack
from duplex.media.playout import PacedPlayout
from duplex.media.video_window import VideoWindow
from duplex.protocol.events import new_id
from duplex.registry import SessionRegistry
from duplex.session.model_pipeline import ModelPipeline
from duplex.session.resume import ResumeStore
from duplex.session.session import Session
from duplex.settings import ServerSettings
from duplex.transports.binding import Closing, SessionBinding
from duplex.transports.outbox import MAX_UNSENT_BYTES, Outbox
from duplex.transports.resumption import Resumption
from duplex.transports.webrtc.ice import IcePolicy
from duplex.transports.webrtc.peer import HUNG_UP, CallPeer

log = logging.getLogger(__name__)


class WebRTCCall:
    kind = "webrtc"

    def __init__(self, settings: ServerSettings, policy: IcePolicy, pipeline: ModelPipeline,
                 registry: SessionRegistry, model_name: str,
                 resume: ResumeStore | None = None) -> None:
        self.id = new_id("rtc")
        self.log = logging.LoggerAdapter(log, {"session_id": self.id})
        self._policy = policy
        self._video = settings.session.video if "image" in pipeline.input_modalities else None
        self._timeout_s = settings.session.inbound_media_timeout_s
        self.outbound = OutboundAudioTrack()
        self.session = Session(self.id, self, PacedPlayout(self.outbound), pipeline,
                               settings.session, settings.voices, model_name)
        # Each peer watches its own inbound audio (peer.py): the binding has no timeout of its own.
        self.binding = SessionBinding(self.session, registry, self._close_peer,
                                      record_dir=settings.record_dir)
        self.resumption = Resumption(self, self.binding, registry, resume)
        self._outbox = Outbox()  # events waiting for an open events channel (module doc)
        self._overflowed = False
        self.peer: CallPeer | None = self._new_peer()  # None while detached
        self.session.video = self.peer.video
        self._closing: Closing | None = None  # the server's own close, once it made one
        self._handling: asyncio.Task[None] | None = None  # the last peer's loss, or an end

    def _new_peer(self) -> CallPeer:
        """A peer for the next offer (the first, or a resume's). A model that sees gets the
        client's camera or screen share, if it sends one, through a window of this peer's."""
        video = VideoWindow(self._video, self.log) if self._video is not None else None
        peer = CallPeer(self.id, self._policy, self, video, self.outbound, self._timeout_s)
        peer.on_open = self._flush
        return peer

    async def start(self, offer_sdp: str, credential: str | None = None) -> str:
        """Admit, answer the offer and start the session; raises TooManySessions or SdpError. A
        client that authenticates with ``credential`` may resume the session."""
        assert self.peer is not None
        self.resumption.admit(credential)
        try:
            answer = await self.peer.answer(offer_sdp)
        except BaseException:
            await self._end("rejected")
            raise
        self.binding.start()
        return answer

    async def resume(self, offer_sdp: str) -> str | None:
        """Serve the session again through a new peer that answers ``offer_sdp`` (its client
        presented the resume token); None, at once, where the session ended meanwhile. Raises
        SdpError for an offer that cannot be answered: the session then ends (its token is used)."""
        if self._handling is not None:
            await asyncio.shield(self._handling)  # the last peer's loss is handled first
        if self.peer is not None:
            # Still attached (the old peer not yet noticed as gone): it is let go as a drop.
            old, self.peer = self.peer, None
            await old.close("replaced by a resumed peer")
            await self._detach("peer replaced by a resumed one")
        if self.binding.ended.is_set() or self._closing is not None:
            return None
        peer = self._new_peer()
        try:
            answer = await peer.answer(offer_sdp)
        except BaseException:
            await self._end("the resumed call's offer was refused")
            raise
        held = self._outbox.take()
        self.peer = peer
        self.session.video = peer.video
        self.resumption.attach()
        self.log.info("session resumed by a new peer (%d events held for the client)", len(held))
        self.session.start()  # session.created, with the next token, before what was held
        for text in held:
            self._hold(text)
        return answer

    async def expire(self) -> None:
        """Nobody resumed the session within the grace period: it ends for good."""
        await self._end("no resume within the grace period")

    async def close(self, reason: str = "hangup") -> None:
        await self.binding.close(reason)

    async def _close_peer(self, closing: Closing) -> None:
        """The server ends the call (hang-up, shutdown, flood): for good, whatever the peer does."""
        self._closing = self._closing or closing
        if self.peer is None:
            await self._end(closing.reason)  # detached: no peer to close
            return
        await self.peer.close(closing.reason)  # its on_closed ends the session

    async def _peer_lost(self, reason: str, resumable: bool) -> None:
        """The current peer is gone: detach the session, or end it (module doc)."""
        if resumable and self.resumption.enabled and self._closing is None and not self._overflowed:
            await self._detach(f"peer {reason}")
        else:
            await self._end(reason)

    async def _detach(self, reason: str) -> None:
        # The paced playout counted only what the peer sent: the audio not sent waits in the
        # track's queue, which the session's cut clears. No audio is held anywhere else.
        await self.resumption.detach(reason, {})

    async def _end(self, reason: str) -> None:
        """End the session for good (idempotent), and the track it played into with it."""
        try:
            await self.resumption.end(reason)
        finally:
            self.outbound.stop()

    # --- SessionTransport --------------------------------------------------------------------

    def send_event(self, event: dict[str, Any]) -> None:
        leaving = self.resumption.outgoing(event)  # session.created gets its token here
        if leaving is None:
            return
        text = json.dumps(leaving)
        peer = self.peer
        if peer is not None and peer.channel_open and not len(self._outbox):
            peer.send_text(text)
        else:
            self._hold(text)

    def _hold(self, text: str) -> None:
        if self._outbox.put(text) or self._overflowed:
            return
        self._overflowed = True
        self.log.warning("more than %d MiB of events wait for an events channel: ending the "
                         "session", MAX_UNSENT_BYTES >> 20)
        self._handling = asyncio.get_running_loop().create_task(
            self._end("too many events waiting for the client"))

    def _flush(self) -> None:
        """The current peer's events channel opened: what waited goes out, in order."""
        peer = self.peer
        if peer is None:
            return  # a resume's peer, not the call's yet: the resume holds what it sends
        for text in self._outbox.take():
            peer.send_text(text)

    # --- PeerListener ------------------------------------------------------------------------

    def on_audio(self, samples: np.ndarray, arrival: float) -> None:
        self.binding.on_audio(samples, arrival)

    def on_message(self, message: str | bytes) -> None:
        self.binding.receive(message)

    def on_closed(self, reason: str) -> None:
        peer = self.peer
        if peer is None or not peer.closed:
            return  # a peer the call let go already (a resume's takeover, a refused answer)
        self.peer = None
        # A client whose events channel never opened never got its token: nobody can resume.
        resumable = peer.opened and reason != HUNG_UP
        self._handling = asyncio.get_running_loop().create_task(self._peer_lost(reason, resumable))
