"""One WebRTC call: a CallPeer (media, events channel) bound to a Session (turns, responses).

The call owns both for their whole life and ends them together: on hang-up, ICE/DTLS failure,
inbound-media timeout or server shutdown, ``close`` releases the peer, the session (its pipeline
request, VAD state, history, queued audio) and its slot in the registry, exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np

from duplex.outbound import Playout
from duplex.playout import PacedPlayout
from duplex.realtime import error_event, new_id
from duplex.registry import SessionRegistry, SessionSlot
from duplex.session import Session
from duplex.settings import ServerSettings
from duplex.webrtc import CallPeer, IcePolicy
from pipeline.coordinator import Coordinator

log = logging.getLogger(__name__)

MAX_QUEUED_EVENTS = 1024  # client events waiting for their turn; beyond, the client is flooding


class WebRTCCall:
    kind = "webrtc"

    def __init__(self, settings: ServerSettings, policy: IcePolicy, pipeline: Coordinator,
                 registry: SessionRegistry, model_name: str) -> None:
        self.id = new_id("rtc")
        self._registry = registry
        self._timeout_s = settings.session.inbound_media_timeout_s
        self._last_audio = time.monotonic()
        self.peer = CallPeer(self.id, policy, self)
        self.session = Session(self.id, self, PacedPlayout(self.peer.outbound), pipeline,
                               settings.session, settings.voices, model_name)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._events: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=MAX_QUEUED_EVENTS)
        self._event_handler: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self.log = logging.LoggerAdapter(log, {"session_id": self.id})

    async def start(self, offer_sdp: str) -> str:
        """Admit, answer the offer and start the session; raises TooManySessions or SdpError."""
        self._registry.admit(
            SessionSlot(self.id, self.kind, self.close, lambda: self.peer.outbound.queued_seconds)
        )
        try:
            answer = await self.peer.answer(offer_sdp)
        except BaseException:
            self._registry.release(self.id)
            raise
        self.session.start()
        loop = asyncio.get_running_loop()
        self._watchdog = loop.create_task(self._watch_inbound())
        self._event_handler = loop.create_task(self._handle_events())
        return answer

    async def close(self, reason: str = "hangup") -> None:
        await self.peer.close(reason)  # reports on_closed, which ends the session
        await self._closed.wait()

    async def _watch_inbound(self) -> None:
        while True:
            idle = time.monotonic() - self._last_audio
            if idle >= self._timeout_s:
                self.log.info("no inbound audio for %.1f s: ending the call", idle)
                await self.peer.close("inbound media timeout")
                return
            await asyncio.sleep(self._timeout_s - idle)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- SessionTransport --------------------------------------------------------------------

    def send_event(self, event: dict[str, Any]) -> None:
        self.peer.send_event(event)

    # --- PeerListener ------------------------------------------------------------------------

    def on_audio(self, samples: np.ndarray, arrival: float) -> None:
        self._last_audio = arrival
        self.session.on_audio(samples, arrival)

    def on_event(self, event: dict[str, Any]) -> None:
        try:
            self._events.put_nowait(event)
        except asyncio.QueueFull:
            self.session.send(error_event(
                f"more than {MAX_QUEUED_EVENTS} events waiting: event dropped", "rate_limited",
                event_id=event.get("event_id")))

    async def _handle_events(self) -> None:
        """Client events one at a time, in order: a handler that awaits is never overtaken."""
        while True:
            await self.session.on_event(await self._events.get())

    def on_bad_event(self, error: str) -> None:
        self.session.send(error_event(error, "invalid_json"))

    def on_playout(self, event: Playout) -> None:
        self.session.on_playout(event.kind, event.item_id)

    def on_closed(self, reason: str) -> None:
        self._spawn(self._end(reason))

    async def _end(self, reason: str) -> None:
        for task in (self._watchdog, self._event_handler):
            if task is not None:
                task.cancel()
        try:
            await self.session.close()
        finally:
            self._registry.release(self.id)
            self._closed.set()
            self.log.info("call ended (%s)", reason)
