"""One transport connection bound to a Session and a registry slot: what every transport shares.

A :class:`SessionBinding` admits the connection (a registry slot, or ``TooManySessions``), starts
its session, takes client events (rate-limited, parsed here, in one place, and handled one at a
time, in order, so a handler that awaits is never overtaken), guards the handlers (an unexpected exception becomes
an ``error`` event and a log line, never a dead handler), and ends everything exactly once: the
session (its pipeline request, VAD state, history, queued audio) and the slot. (A WebRTC peer
watches its own inbound audio: webrtc/peer.py.)

It lives as long as its connection; the transport (WebRTC call, WebSocket, ...) owns it and keeps
only what really differs: how media and events travel, and how the connection itself is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from duplex.media.recording import CallRecording
from duplex.protocol.events import error_event
from duplex.rate_limit import TokenBucket
from duplex.registry import SessionRegistry, SessionSlot
from duplex.session.client_events import ClientEvents, client_event_id
from duplex.session.session import Session

log = logging.getLogger(__name__)

MAX_QUEUED_EVENTS = 1024  # client events waiting for their turn; beyond, the client is flooding

# Client events per connection, a token bucket. A client appending audio every 20 ms sends 50
# events a second, and everything else it sends (session.update, commit, response.create, item
# operations) is a few more: 200 a second is four times that. The burst lets a client replay a
# history of items or catch up on 10 s of 20-ms appends after a network stall at once. A client
# over the limit gets MAX_RATE_ERRORS ``rate_limited`` errors (its events dropped), then is closed
# (WebSocket: 1008): a flood costs the server a bounded amount of work before it ends, so it cannot
# slow the other sessions down. It is forgiven once half its bucket has filled again.
EVENT_RATE = 200.0
EVENT_BURST = 1000
MAX_RATE_ERRORS = 20


@dataclass(frozen=True)
class Closing:
    """Why the server ends a connection, for its transport to say in its own way: a WebSocket
    closes with 1008 (policy violation) where the client broke a rule, 1000 (normal closure) where
    the agent ended the call (``hung_up``: idle, longest call), 1001 (going away) otherwise; a
    phone call hangs up either way."""

    reason: str
    clients_fault: bool = False
    hung_up: bool = False

    @property
    def websocket_code(self) -> int:
        return 1008 if self.clients_fault else 1000 if self.hung_up else 1001


FLOODING = Closing("client event rate limit exceeded", clients_fault=True)
# Messages in a row that are no event of the protocol (not JSON, not an object, no or an unknown
# type): a client that sends only those is broken or hostile, and each costs an error event. A
# real client's bugs make a few; the bound ends a garbage stream long before its rate limit would.
MAX_MALFORMED_RUN = 200
MALFORMED = Closing(f"more than {MAX_MALFORMED_RUN} malformed events in a row", clients_fault=True)


class SessionBinding:
    """See module doc. ``close_transport(closing)`` closes the connection from the server side and
    must lead, sooner or later, to :meth:`end` (the transport's own end-of-connection path)."""

    def __init__(self, session: Session, registry: SessionRegistry,
                 close_transport: Callable[[Closing], Awaitable[None]],
                 shared_budget: TokenBucket | None = None,
                 record_dir: str | None = None) -> None:
        self.session = session
        self._record_dir = record_dir
        self.recording: CallRecording | None = None  # from start to end, with record_dir
        self.events = ClientEvents(session)
        self._registry = registry
        self._close_transport = close_transport
        self._queue: asyncio.Queue[str | bytes] = asyncio.Queue(maxsize=MAX_QUEUED_EVENTS)
        self._tasks: list[asyncio.Task[None]] = []
        self._bucket = TokenBucket(EVENT_RATE, EVENT_BURST)
        # The client's budget over all its connections, where the transport knows the client.
        self._shared = shared_budget
        self._refused = 0  # events refused by the rate limit since the client was last forgiven
        self._malformed = 0  # malformed messages since the last event of the protocol
        self._closing: asyncio.Task[None] | None = None
        self._ending = False
        self.ended = asyncio.Event()
        self.log = logging.LoggerAdapter(log, {"session_id": session.id})

    @property
    def id(self) -> str:
        return self.session.id

    def admit(self) -> None:
        """Take a registry slot; raises TooManySessions."""
        self._registry.admit(SessionSlot(self.id, self.session.transport.kind, self.close,
                                         self.session.audio.queued_seconds))

    def start(self) -> None:
        """Start the session (``session.created``) and the event handler (after ``admit``)."""
        if self._record_dir is not None:
            self._record()
        self.session.start()
        self.session.idle.start(self._hang_up)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._handle_queued()))

    async def ended_within(self, grace_s: float, connection: asyncio.Task[Any] | None) -> None:
        """Wait up to ``grace_s`` for the end, then cancel ``connection`` (the task serving the
        transport): for transports whose peer must answer a close first and may never do."""
        try:
            await asyncio.wait_for(asyncio.shield(self.ended.wait()), grace_s)
        except TimeoutError:
            if connection is not None:
                connection.cancel()

    def _record(self) -> None:
        """Record the call: the caller's audio (the session's one inbound path), the agent's as its
        AgentAudio says it was heard, and every event both ways (module doc of recording)."""
        session = self.session
        try:
            recording = CallRecording(self._record_dir, self.id, session.transport.kind)
        except OSError as err:
            self.log.warning("the call cannot be recorded: %s", err)
            return
        # The agent's audio reaches it through the front end's tap (the echo canceller's far end).
        self.recording = session.recording = session.front_end.far_end.downstream = recording
        session.transport = _RecordedTransport(session.transport, recording)

    def _hang_up(self, reason: str) -> None:
        """The agent ends the call (duplex/session/idle.py): the transport's own hang-up."""
        if self._closing is None:
            self.log.info("the agent ends the call: %s", reason)
            self._closing = asyncio.get_running_loop().create_task(
                self._close_transport(Closing(reason, hung_up=True)))

    async def close(self, reason: str = "closed by the server") -> None:
        """End the connection from the server side and wait until everything is released."""
        await self._close_transport(Closing(reason))
        await self.ended.wait()

    # --- inbound ------------------------------------------------------------------------------

    def on_audio(self, samples: np.ndarray, arrival: float) -> None:
        """Inbound audio at 16 kHz (float32 mono); ``arrival`` is monotonic."""
        self.session.on_audio(samples, arrival)

    def parse(self, raw: str | bytes) -> dict[str, Any] | None:
        """A client message as an event object, or None after an ``error`` event saying why."""
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            message = json.loads(text)
        except UnicodeDecodeError:
            return self._refuse_malformed("a binary message must be UTF-8 JSON", "invalid_json")
        except (ValueError, RecursionError) as err:
            return self._refuse_malformed(f"the message is not valid JSON: {err}", "invalid_json")
        if not isinstance(message, dict):
            return self._refuse_malformed("an event must be a JSON object", "invalid_event")
        return message

    def _refuse_malformed(self, message: str, code: str) -> None:
        self.session.send(error_event(message, code))
        self._count_malformed(True)

    def _count_malformed(self, malformed: bool) -> None:
        """Past :data:`MAX_MALFORMED_RUN` malformed messages in a row, close as :data:`MALFORMED`."""
        self._malformed = self._malformed + 1 if malformed else 0
        if self._malformed > MAX_MALFORMED_RUN and self._closing is None:
            self.log.warning("client sends only malformed events: closing the connection")
            self._closing = asyncio.get_running_loop().create_task(self._close_transport(MALFORMED))

    def admit_event(self) -> bool:
        """Whether one more client message may be handled now (see :data:`EVENT_RATE`). When not,
        the client gets a ``rate_limited`` error, or, past :data:`MAX_RATE_ERRORS` of them, the
        connection is closed as :data:`FLOODING`."""
        if self._bucket.take() and (self._shared is None or self._shared.take()):
            if self._refused and self._bucket.tokens >= EVENT_BURST / 2:
                self._refused = 0
            return True
        self._refused += 1
        if self._refused <= MAX_RATE_ERRORS:
            self.session.send(error_event(
                f"more than {EVENT_RATE:.0f} events a second (bursts of {EVENT_BURST}): event "
                f"dropped; after {MAX_RATE_ERRORS} such errors the connection is closed",
                "rate_limited"))
        elif self._closing is None:
            self.log.warning("client flooding with events: closing the connection")
            self._closing = asyncio.get_running_loop().create_task(self._close_transport(FLOODING))
        return False

    def receive(self, raw: str | bytes) -> None:
        """A message from a transport that delivers in callbacks: rate-limited, parsed and handled
        in order."""
        if not self.admit_event():
            return
        try:
            self._queue.put_nowait(raw)
        except asyncio.QueueFull:
            self.session.send(error_event(
                f"more than {MAX_QUEUED_EVENTS} events waiting: event dropped", "rate_limited"))

    async def handle(self, message: dict[str, Any]) -> None:
        """Handle one client event now; an unexpected failure becomes an ``error`` event. Returns
        only after the loop ran other work: a client's backlog of events (they wait in a queue that
        answers at once while it holds any) is never handled as one long callback, even where each
        handler completes without awaiting."""
        if self.recording is not None:
            self.recording.client_event(message)
        try:
            self._count_malformed(not await self.events.handle(message))
        except Exception:  # one bad event must not end the session or the server
            kind = message.get("type")
            self.log.exception("event %r failed", kind)
            self.session.send(error_event("the server failed to handle this event", "server_error",
                                          event_id=client_event_id(message), kind="server_error"))
        await asyncio.sleep(0)

    async def _handle_queued(self) -> None:
        while True:
            message = self.parse(await self._queue.get())
            if message is not None:
                await self.handle(message)

    # --- the end ------------------------------------------------------------------------------

    async def end(self, reason: str) -> None:
        """Release the session and the slot, once; the transport calls this when it is gone."""
        if self._ending:
            await self.ended.wait()
            return
        self._ending = True
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        # A cancelled task keeps its frames (through its exception's traceback), and those this
        # binding: holding the tasks, and the transport's close, would make cycles that keep the
        # closed session alive until Python's cyclic garbage collector runs (Session._let_go).
        self._tasks.clear()
        self._close_transport = _already_closed
        try:
            await self.session.close()
        finally:
            if self.recording is not None:
                self.recording.close(reason)
                self.recording = None
            self._registry.release(self.id)
            self.ended.set()
            self.log.info("session ended (%s)", reason)


class _RecordedTransport:
    """A session's transport whose server events a recording sees first."""

    def __init__(self, inner: Any, recording: CallRecording) -> None:
        self.kind = inner.kind
        self._inner = inner
        self._recording = recording

    def send_event(self, event: dict[str, Any]) -> None:
        self._recording.server_event(event)
        self._inner.send_event(event)


async def _already_closed(closing: Closing) -> None:
    """The transport's close once the binding ended: the connection is gone already."""
