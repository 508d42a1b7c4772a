"""One WebRTC call: a CallPeer (media, events channel) bound to a Session through a SessionBinding.

The call owns its peer and its binding for their whole life and ends them together: on hang-up,
ICE/DTLS failure, inbound-media timeout or server shutdown, the peer closes and reports
``on_closed``, and the binding releases the session and its registry slot, exactly once.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from duplex.media.playout import PacedPlayout
from duplex.media.video_window import VideoWindow
from duplex.protocol.events import new_id
from duplex.registry import SessionRegistry
from duplex.session.model_pipeline import ModelPipeline
from duplex.session.session import Session
from duplex.settings import ServerSettings
from duplex.transports.binding import Closing, SessionBinding
from duplex.transports.webrtc.ice import IcePolicy
from duplex.transports.webrtc.peer import CallPeer

log = logging.getLogger(__name__)


class WebRTCCall:
    kind = "webrtc"

    def __init__(self, settings: ServerSettings, policy: IcePolicy, pipeline: ModelPipeline,
                 registry: SessionRegistry, model_name: str) -> None:
        self.id = new_id("rtc")
        # A model that sees gets the client's camera or screen share, if it sends one.
        video = (VideoWindow(settings.session.video, logging.LoggerAdapter(log, {"session_id": self.id}))
                 if "image" in pipeline.input_modalities else None)
        self.peer = CallPeer(self.id, policy, self, video)
        self.session = Session(self.id, self, PacedPlayout(self.peer.outbound), pipeline,
                               settings.session, settings.voices, model_name)
        self.session.video = video
        self.binding = SessionBinding(self.session, registry, self._close_peer,
                                      settings.session.inbound_media_timeout_s,
                                      record_dir=settings.record_dir)
        self._ending: asyncio.Task[None] | None = None

    async def start(self, offer_sdp: str) -> str:
        """Admit, answer the offer and start the session; raises TooManySessions or SdpError."""
        self.binding.admit()
        try:
            answer = await self.peer.answer(offer_sdp)
        except BaseException:
            await self.binding.end("rejected")
            raise
        self.binding.start()
        return answer

    async def close(self, reason: str = "hangup") -> None:
        await self.binding.close(reason)

    async def _close_peer(self, closing: Closing) -> None:
        await self.peer.close(closing.reason)

    # --- SessionTransport --------------------------------------------------------------------

    def send_event(self, event: dict[str, object]) -> None:
        self.peer.send_event(event)

    # --- PeerListener ------------------------------------------------------------------------

    def on_audio(self, samples: np.ndarray, arrival: float) -> None:
        self.binding.on_audio(samples, arrival)

    def on_message(self, message: str | bytes) -> None:
        self.binding.receive(message)

    def on_closed(self, reason: str) -> None:
        if self._ending is None:
            self._ending = asyncio.get_running_loop().create_task(self.binding.end(reason))
