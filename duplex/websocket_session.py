"""One Realtime WebSocket connection (``GET /v1/realtime``) bound to a Session.

The WebSocket twin of ``duplex/call.py``: the same Session (turns, VAD, barge-in, truncation,
responses) behind a different transport. Client events arrive as JSON text messages and are handled
one at a time, in order (an ``append`` then a ``commit`` must not swap); server events leave through
one writer task, in the order the session sent them. Agent audio leaves as
``response.output_audio.delta`` events that the session sends itself (``ClientPlayout``: the client
plays the audio, the server counts what it sent).

The connection owns its session and its registry slot from ``admit`` until ``run`` returns: when the
client closes, the socket breaks, a message is too large (uvicorn closes with 1009) or the server
shuts down, ``run`` closes the session (aborting the pipeline request in flight, dropping VAD state
and history) and releases the slot, exactly once. There is no inbound-media timeout here, unlike
WebRTC: a WebSocket client sends audio only when it has some, and the socket itself (close frame,
TCP reset, uvicorn's keepalive pings) tells when the client is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from duplex.playout import ClientPlayout
from duplex.realtime import error_event, new_id
from duplex.registry import SessionRegistry, SessionSlot
from duplex.session import Session
from duplex.settings import ServerSettings
from pipeline.coordinator import Coordinator

log = logging.getLogger(__name__)

CLOSE_GOING_AWAY = 1001
SHUTDOWN_GRACE_S = 5.0


@dataclass(frozen=True)
class _Close:
    """Queued after the events that must go out first: the writer then closes the socket."""

    code: int
    reason: str


class WebSocketSession:
    kind = "websocket"

    def __init__(self, websocket: WebSocket, settings: ServerSettings, pipeline: Coordinator,
                 registry: SessionRegistry, model_name: str) -> None:
        self.id = new_id("sess")
        self.websocket = websocket
        self._registry = registry
        self._outbox: asyncio.Queue[dict[str, Any] | _Close] = asyncio.Queue()
        self.session = Session(self.id, self, ClientPlayout(), pipeline, settings.session,
                               settings.voices, model_name)
        self._task: asyncio.Task[Any] | None = None
        self._ended = asyncio.Event()
        self.log = logging.LoggerAdapter(log, {"session_id": self.id})

    def admit(self) -> None:
        """Take a slot in the registry; raises TooManySessions."""
        self._registry.admit(SessionSlot(self.id, self.kind, self.close))

    async def run(self) -> None:
        """Serve the connection until it ends, then release everything (call after ``admit``)."""
        self._task = asyncio.current_task()
        writer = asyncio.get_running_loop().create_task(self._write())
        reason = "cancelled"
        try:
            self.session.start()
            reason = await self._read()
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            try:
                await self.session.close()
            finally:
                self._registry.release(self.id)
                self._ended.set()
                self.log.info("websocket session ended (%s)", reason)

    async def close(self) -> None:
        """End the connection from the server (shutdown): close frame, then wait for ``run``."""
        self._outbox.put_nowait(_Close(CLOSE_GOING_AWAY, "server shutting down"))
        try:
            await asyncio.wait_for(self._ended.wait(), SHUTDOWN_GRACE_S)
        except TimeoutError:
            # The client never answered the close frame: stop waiting for it.
            if self._task is not None:
                self._task.cancel()
            await self._ended.wait()

    # --- SessionTransport --------------------------------------------------------------------

    def send_event(self, event: dict[str, Any]) -> None:
        self._outbox.put_nowait(event)

    # --- the two directions ------------------------------------------------------------------

    async def _read(self) -> str:
        """Client events, one at a time, until the client is gone; returns why it ended."""
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return f"closed with {message.get('code')}"
            event = self._parse(message)
            if event is None:
                continue
            try:
                await self.session.on_event(event)
            except Exception:  # noqa: BLE001 - one bad event must not end the session or the server
                kind = event.get("type") if isinstance(event, dict) else type(event).__name__
                self.log.exception("event %r failed", kind)
                self.session.send(error_event("the server failed to handle this event",
                                              "server_error", kind="server_error"))

    def _parse(self, message: dict[str, Any]) -> Any:
        """The JSON of a text (or UTF-8 binary) message, or None after an ``error`` event."""
        text = message.get("text")
        if text is None:
            try:
                text = (message.get("bytes") or b"").decode("utf-8")
            except UnicodeDecodeError:
                self.session.send(error_event("a binary message must be UTF-8 JSON",
                                              "invalid_json"))
                return None
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as err:
            self.session.send(error_event(f"the message is not valid JSON: {err}", "invalid_json"))
            return None

    async def _write(self) -> None:
        while True:
            item = await self._outbox.get()
            try:
                if isinstance(item, _Close):
                    await self.websocket.close(item.code, item.reason)
                    return
                await self.websocket.send_text(json.dumps(item))
            except (WebSocketDisconnect, RuntimeError, OSError) as err:
                # The client is gone; the reader sees the disconnect and ends the session.
                self.log.info("websocket send failed: %s", err)
                return
