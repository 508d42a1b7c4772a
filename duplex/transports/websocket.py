"""One Realtime WebSocket session (``GET /v1/realtime``): a Session served over one socket at a
time, and kept for a while when that socket drops.

The WebSocket twin of ``webrtc/call.py``: the same Session (turns, VAD, barge-in, truncation,
responses) and SessionBinding behind a different transport. Client events arrive as JSON text
messages and are handled one at a time, in order (an ``append`` then a ``commit`` must not swap);
server events leave through one writer task, in the order the session sent them. Agent audio leaves
as ``response.output_audio.delta`` events (``ClientPlayout``: the client plays the audio, the server
counts what it sent).

Resumption (docs/resume.md, :mod:`duplex.session.resume`; what WebRTC calls share with this is in
:mod:`duplex.transports.resumption` and :mod:`duplex.transports.outbox`): each ``session.created``
carries a new resume token (added as the event leaves, so that no recording or log line of the
session's events holds it). When the socket drops (any end but the client's normal close, 1000, or
a close for breaking the protocol), the session is not ended: it is *detached* — the audio still
waiting to be written is dropped, the response in flight is cut to the audio written to the socket
(``Session.connection_lost``), and its slot is kept — until a client presents the token (``resume``:
a new ``session.created``, then the events the session sent meanwhile, audio aside) or the grace
period ends (``expire``: the session is ended for good). A resume that finds the session still
attached (its old socket half-open, as after a phone's network hand-over) ends that socket first,
as a drop.

The connection owns its binding from ``admit`` until the session ends: when the client closes, a
message is too large (uvicorn closes with 1009), the server shuts down or the grace period runs
out, the binding is ended (closing the session, releasing the slot) exactly once. There is no
inbound-media timeout here, unlike WebRTC: a WebSocket client sends audio only when it has some,
and the socket itself (close frame, TCP reset, uvicorn's keepalive pings) tells when it is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from duplex.media.playout import ClientPlayout
from duplex.protocol.events import new_id
from duplex.protocol.wire_audio import wire_seconds
from duplex.rate_limit import TokenBucket
from duplex.registry import SessionRegistry
from duplex.session.model_pipeline import ModelPipeline
from duplex.session.resume import ResumeStore
from duplex.session.session import Session
from duplex.settings import ServerSettings
from duplex.transports.binding import Closing, SessionBinding
from duplex.transports.outbox import MAX_UNSENT_BYTES, Outbox
from duplex.transports.resumption import AUDIO_DELTA, Resumption

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
# Close codes after which the session is not kept for a resume: the client's normal closure (it
# is done) and those that say it broke the protocol (garbage, a message too large, ...).
FINAL_CLOSE_CODES = frozenset({1000, 1002, 1003, 1007, 1008, 1009, 1010})


class WebSocketConnection:
    kind = "websocket"

    def __init__(self, websocket: WebSocket, settings: ServerSettings, pipeline: ModelPipeline,
                 registry: SessionRegistry, model_name: str,
                 client_budget: TokenBucket | None = None,
                 resume: ResumeStore | None = None) -> None:
        self.id = new_id("sess")
        self.websocket = websocket
        # Events waiting for a client that does not read them (its socket buffers are full), or
        # for a client to resume its session; then a Closing (the writer then closes). Past the
        # outbox's bound the session is ended: its memory must not grow with a client that went
        # deaf or away.
        self._outbox = Outbox()
        self.session = Session(self.id, self, ClientPlayout(), pipeline, settings.session,
                               settings.voices, model_name)
        # client_budget: the client address's events over all its connections (AppState).
        self.binding = SessionBinding(self.session, registry, self._close,
                                      shared_budget=client_budget, record_dir=settings.record_dir)
        self.resumption = Resumption(self, self.binding, registry, resume)
        self._task: asyncio.Task[Any] | None = None  # serves the current socket
        self._reader: asyncio.Task[tuple[str, bool]] | None = None
        self._served = asyncio.Event()  # set while no socket is served (detached or ended)
        self._served.set()
        self._deaf = False  # the client stopped reading: the connection is being ended
        self.closing: Closing | None = None  # why the server ended the connection, if it did
        self.log = logging.LoggerAdapter(log, {"session_id": self.id})

    def admit(self, credential: str | None = None) -> None:
        """Take a slot in the registry (raises TooManySessions); a client that authenticates with
        ``credential`` may resume the session."""
        self.resumption.admit(credential)

    async def run(self) -> None:
        """Serve the first socket until it ends (call after ``admit``)."""
        await self._serve(self.websocket, self.binding.start)

    async def resume(self, websocket: WebSocket) -> bool:
        """Serve the session again over ``websocket``, whose client presented its resume token;
        False, at once, where the session ended meanwhile (its old socket closed for good)."""
        if not self._served.is_set():
            # Still attached (the old socket half-open): that socket is ended as a drop.
            self.log.info("resumed while attached: the previous socket is let go")
            if self._reader is not None:
                self._reader.cancel()
            try:
                await self._served.wait()
            except asyncio.CancelledError:
                await self._end("cancelled while resuming")
                raise
        if self.binding.ended.is_set() or self.closing is not None:
            return False
        held = self._outbox.take()
        self.resumption.attach()
        self.log.info("session resumed (%d events held for the client)", len(held))

        def restart() -> None:
            self.session.start()  # session.created, with the next token, before what was held
            for item in held:
                self._queue(item)

        await self._serve(websocket, restart)
        return True

    async def expire(self) -> None:
        """Nobody resumed the session within the grace period: it ends for good."""
        await self._end("no resume within the grace period")

    async def _serve(self, websocket: WebSocket, start: Callable[[], None]) -> None:
        """Serve ``websocket`` until it ends; then detach the session, or end it."""
        self.websocket = websocket
        self._served.clear()
        self._task = asyncio.current_task()
        writer = asyncio.get_running_loop().create_task(self._write())
        reason, resumable = "cancelled", False
        try:
            start()
            self._reader = asyncio.get_running_loop().create_task(self._read())
            reason, resumable = await self._reader
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._reader is None or not self._reader.cancelled() or (task and task.cancelling()):
                raise
            reason, resumable = "replaced by a resumed connection", True
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            try:
                keep = resumable and self.closing is None and not self._deaf
                if keep and self.resumption.enabled:
                    await self._detach(reason)
                else:
                    await self._end(f"websocket {reason}")
            finally:
                # A finished task holds its frames: no reference cycle through this connection.
                self._reader = self._task = None
                self._served.set()

    async def _detach(self, reason: str) -> None:
        """The socket dropped: keep the session for a resume (module doc)."""
        await self.resumption.detach(f"websocket {reason}", self._drop_unsent_audio())

    async def _end(self, reason: str) -> None:
        await self.resumption.end(reason)

    async def _close(self, closing: Closing) -> None:
        """End the connection from the server (shutdown, flood, hang-up): close frame after the
        events already queued, then wait for ``run``; a detached session just ends."""
        self.closing = self.closing or closing
        if self.resumption.detached:
            await self._end(closing.reason)
            return
        self._outbox.close_after(closing)
        await self.binding.ended_within(SHUTDOWN_GRACE_S, self._task)

    # --- SessionTransport --------------------------------------------------------------------

    def send_event(self, event: dict[str, Any]) -> None:
        leaving = self.resumption.outgoing(event)  # audio while detached: dropped
        if leaving is not None:
            self._queue(json.dumps(leaving))

    def _queue(self, text: str) -> None:
        if self._outbox.put(text) or self._deaf:
            return
        self._deaf = True
        if self.resumption.detached:
            self.log.warning("more than %d MiB of events wait for a resume: ending the session",
                             MAX_UNSENT_BYTES >> 20)
            self.resumption.end_soon("too many events waiting for a resume")
        elif self._task is not None:
            self.log.warning("the client reads none of its last %d MiB of events: ending the session",
                             MAX_UNSENT_BYTES >> 20)
            self._task.cancel()

    def _drop_unsent_audio(self) -> dict[str, int]:
        """Drop the audio the socket never took (the outbox's audio deltas); returns how many
        milliseconds of each item's audio it held."""
        fmt = self.session.config.output_format
        unsent: dict[str, float] = {}
        for text in self._outbox.take():
            event = json.loads(text)
            if event.get("type") == AUDIO_DELTA:
                item_id = str(event.get("item_id"))
                unsent[item_id] = unsent.get(item_id, 0.0) + wire_seconds(fmt, event.get("delta", ""))
            else:
                self._queue(text)
        return {item_id: round(seconds * 1000) for item_id, seconds in unsent.items()}

    # --- the two directions ------------------------------------------------------------------

    async def _read(self) -> tuple[str, bool]:
        """Client events, one at a time, until the client is gone; returns why it ended, and
        whether the session may wait for a resume."""
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                code = message.get("code")
                return f"closed with {code}", code not in FINAL_CLOSE_CODES
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
                await self.websocket.send_text(item)
            except (WebSocketDisconnect, RuntimeError, OSError) as err:
                # The client is gone; the reader sees the disconnect and ends the session. The
                # error goes to the log as text: a record holding the exception (kept by a handler
                # that keeps records, as pytest's does) would hold its traceback's frames, and
                # this connection with them.
                self.log.info("websocket send failed: %s", repr(err))
                return
