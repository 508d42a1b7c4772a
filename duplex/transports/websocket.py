"""One Realtime WebSocket connection (``GET /v1/realtime``) bound to a Session.

The WebSocket twin of ``webrtc/call.py``: the same Session (turns, VAD, barge-in, truncation,
responses) and SessionBinding behind a different transport. Client events arrive as JSON text
messages and are handled one at a time, in order (an ``append`` then a ``commit`` must not swap);
server events leave through one writer task, in the order the session sent them. Agent audio leaves
as ``response.output_audio.delta`` events (``ClientPlayout``: the client plays the audio, the server
counts what it sent).

The connection owns its binding from ``admit`` until ``run`` returns: when the client closes, the
socket breaks, a message is too large (uvicorn closes with 1009) or the server shuts down, ``run``
ends the binding (closing the session, releasing the slot) exactly once. There is no inbound-media
timeout here, unlike WebRTC: a WebSocket client sends audio only when it has some, and the socket
itself (close frame, TCP reset, uvicorn's keepalive pings) tells when the client is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from duplex.media.playout import ClientPlayout
from duplex.protocol.events import new_id
from duplex.rate_limit import TokenBucket
from duplex.registry import SessionRegistry
from duplex.session.model_pipeline import ModelPipeline
from duplex.session.session import Session
from duplex.settings import ServerSettings
from duplex.transports.binding import Closing, SessionBinding

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
# Server events waiting for a client that does not read them (its socket buffers are full). Beyond
# this the client is ended: a session's memory must not grow with a client that went deaf. A
# second of agent audio is ~64 kB of events, so this is minutes of a client that only lags.
MAX_UNSENT_BYTES = 8 * 1024 * 1024


class WebSocketConnection:
    kind = "websocket"

    def __init__(self, websocket: WebSocket, settings: ServerSettings, pipeline: ModelPipeline,
                 registry: SessionRegistry, model_name: str,
                 client_budget: TokenBucket | None = None) -> None:
        self.id = new_id("sess")
        self.websocket = websocket
        # Events, then a Closing queued after those that must go out first (the writer then closes).
        self._outbox: asyncio.Queue[str | Closing] = asyncio.Queue()
        self._unsent = 0  # bytes of the events in the outbox
        self.session = Session(self.id, self, ClientPlayout(), pipeline, settings.session,
                               settings.voices, model_name)
        # client_budget: the client address's events over all its connections (AppState).
        self.binding = SessionBinding(self.session, registry, self._close,
                                      shared_budget=client_budget, record_dir=settings.record_dir)
        self._task: asyncio.Task[Any] | None = None
        self._deaf = False  # the client stopped reading: the connection is being ended
        self.closing: Closing | None = None  # why the server ended the connection, if it did
        self.log = logging.LoggerAdapter(log, {"session_id": self.id})

    def admit(self) -> None:
        """Take a slot in the registry; raises TooManySessions."""
        self.binding.admit()

    async def run(self) -> None:
        """Serve the connection until it ends, then release everything (call after ``admit``)."""
        self._task = asyncio.current_task()
        writer = asyncio.get_running_loop().create_task(self._write())
        reason = "cancelled"
        try:
            self.binding.start()
            reason = await self._read()
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            await self.binding.end(f"websocket {reason}")

    async def _close(self, closing: Closing) -> None:
        """End the connection from the server (shutdown, flood): close frame after the events
        already queued, then wait for ``run``."""
        self.closing = self.closing or closing
        self._outbox.put_nowait(closing)
        await self.binding.ended_within(SHUTDOWN_GRACE_S, self._task)

    # --- SessionTransport --------------------------------------------------------------------

    def send_event(self, event: dict[str, Any]) -> None:
        text = json.dumps(event)
        if self._unsent + len(text) <= MAX_UNSENT_BYTES:
            self._unsent += len(text)
            self._outbox.put_nowait(text)
            return
        if not self._deaf and self._task is not None:
            self._deaf = True
            self.log.warning("the client reads none of its last %d MiB of events: ending the session",
                             MAX_UNSENT_BYTES >> 20)
            self._task.cancel()

    # --- the two directions ------------------------------------------------------------------

    async def _read(self) -> str:
        """Client events, one at a time, until the client is gone; returns why it ended."""
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return f"closed with {message.get('code')}"
            if not self.binding.admit_event():
                continue
            event = self.binding.parse(message.get("text") or message.get("bytes") or b"")
            if event is not None:
                await self.binding.handle(event)

    async def _write(self) -> None:
        while True:
            item = await self._outbox.get()
            try:
                if isinstance(item, Closing):
                    await self.websocket.close(item.websocket_code, item.reason)
                    return
                self._unsent -= len(item)
                await self.websocket.send_text(item)
            except (WebSocketDisconnect, RuntimeError, OSError) as err:
                # The client is gone; the reader sees the disconnect and ends the session.
                self.log.info("websocket send failed: %s", err)
                return
