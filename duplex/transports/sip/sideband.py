"""A SIP call's events over a WebSocket: ``GET /v1/realtime?call_id=…``, OpenAI's sideband.

A phone call carries audio only. An app that wants to follow or steer a call (incoming or one it
placed) opens the sideband: a Realtime WebSocket attached to the call's running session. Over it:

- the server events of the call's session, in order, from its opening on (the first one is a
  ``session.created`` describing the session as it is now; audio stays on the phone line);
- the client events the app sends (``session.update``, ``response.create``,
  ``conversation.item.create``, ...), handled by the call's binding as a Realtime WebSocket's
  are: the same rate limit, parsing and order, one at a time.

One sideband per call: a second while one is attached is refused (:class:`SidebandInUse`). When
the socket closes the sideband is let go and the call goes on (a new one may attach); when the call
ends, the sideband is closed with 1000 after the events already queued. Events for a sideband whose
client stops reading are bounded (:data:`MAX_UNSENT_BYTES`): past it the socket is dropped, the call
goes on.

A :class:`Sideband` belongs to the API handler that serves its socket (duplex/api/realtime_ws.py)
and lives until that socket ends; the call (agent.py) holds it while attached.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from duplex.protocol.events import event

if TYPE_CHECKING:
    from .agent import SipSessionCall

log = logging.getLogger(__name__)

MAX_UNSENT_BYTES = 8 * 1024 * 1024  # as a Realtime WebSocket's (transports/websocket.py)
CALL_ENDED = 1000


class SidebandInUse(Exception):
    """The call has a sideband attached already."""


class Sideband:
    """One WebSocket attached to one SIP call's session (module doc)."""

    def __init__(self, websocket: WebSocket, call: SipSessionCall) -> None:
        self.websocket = websocket
        self.call = call
        self._outbox: asyncio.Queue[str | None] = asyncio.Queue()  # None: the call ended
        self._unsent = 0
        self._reader: asyncio.Task[None] | None = None
        self._deaf = False  # the client stopped reading: its socket is being dropped
        self.log = logging.LoggerAdapter(log, {"session_id": call.id})

    async def run(self) -> None:
        """Attach to the call (raises SidebandInUse) and serve the socket until it ends."""
        self.call.attach(self)
        self.log.info("sideband attached")
        writer = asyncio.get_running_loop().create_task(self._write())
        try:
            self.send(event("session.created", session=self.call.session.session_object()))
            self._reader = asyncio.current_task()
            await self._read()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._deaf or task is None or task.uncancel() > 0:
                raise  # not (only) our own cancel for a deaf client (send): the server's
            self.log.info("sideband dropped: its client reads nothing")
        finally:
            self._reader = None
            self.call.detach(self)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            self.log.info("sideband detached; the call goes on")

    def send(self, message: dict[str, Any]) -> None:
        """A server event of the call's session."""
        text = json.dumps(message)
        if self._unsent + len(text) > MAX_UNSENT_BYTES:
            if self._reader is not None and not self._deaf:
                self._deaf = True
                self.log.warning("the sideband's client reads none of its last %d MiB: dropping it",
                                 MAX_UNSENT_BYTES >> 20)
                self._reader.cancel()
            return
        self._unsent += len(text)
        self._outbox.put_nowait(text)

    def call_ended(self) -> None:
        """Close the socket after the events already queued."""
        self._outbox.put_nowait(None)

    async def _read(self) -> None:
        binding = self.call.binding
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            if binding.ended.is_set() or not binding.admit_event():
                continue
            parsed = binding.parse(message.get("text") or message.get("bytes") or b"")
            if parsed is not None:
                await binding.handle(parsed)

    async def _write(self) -> None:
        while True:
            item = await self._outbox.get()
            try:
                if item is None:
                    await self.websocket.close(CALL_ENDED, "the call ended")
                    return
                self._unsent -= len(item)
                await self.websocket.send_text(item)
            except (WebSocketDisconnect, RuntimeError, OSError) as err:
                self.log.info("sideband send failed: %s", err)  # the reader sees the disconnect
                return
