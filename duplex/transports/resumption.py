"""What every resumable transport does alike for sessions that survive a dropped connection
(docs/resume.md): the Realtime WebSocket (``websocket.py``) and a WebRTC call (``webrtc/call.py``).

A :class:`Resumption` belongs to one connection object (the ``Resumable`` that the
:class:`~duplex.session.resume.ResumeStore` holds: the object a resume finds) and lives as long as
its session. It owns the session's enrolment in the store, from ``admit`` until ``end``; it puts the
live token into each ``session.created`` as the event leaves (after a recording saw it: no recording
or log line of the session's events holds it); and it does the bookkeeping of a drop (``detach``:
the registry's ``duplex_sessions_awaiting_resume``, the store's grace period, the session's cut of
what was in flight) and of a resume (``attach``). How a transport notices a drop, which ends are
final, and how it holds and replays the events meanwhile (an
:class:`~duplex.transports.outbox.Outbox`) stay the transport's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from duplex.registry import SessionRegistry
from duplex.session.resume import Resumable, ResumeStore
from duplex.transports.binding import SessionBinding

log = logging.getLogger(__name__)

# Audio events are never held for a session waiting for its client: audio in flight is dropped.
AUDIO_DELTA = "response.output_audio.delta"


class Resumption:
    """See module doc. ``store`` None or disabled (``resume_grace_s: 0``): no token, and every
    drop ends the session (``enabled`` False)."""

    def __init__(self, holder: Resumable, binding: SessionBinding, registry: SessionRegistry,
                 store: ResumeStore | None) -> None:
        # The holder (the connection object, which owns this) is let go at the end: no cycle
        # outlives the session.
        self._holder: Resumable | None = holder
        self.binding = binding
        self._registry = registry
        self.store = store if store is not None and store.enabled else None
        self.detached = False  # the connection dropped: waiting for a resume
        self._ending: asyncio.Task[None] | None = None
        self.log = logging.LoggerAdapter(log, {"session_id": binding.id})

    @property
    def enabled(self) -> bool:
        return self.store is not None and self._holder is not None

    def admit(self, credential: str | None) -> None:
        """Take a registry slot (raises TooManySessions); a client that authenticates with
        ``credential`` may then resume the session."""
        self.binding.admit()
        if self.store is not None and self._holder is not None:
            self.store.enrol(self._holder, credential)

    def outgoing(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """``event`` as it leaves for the client: None for audio while nobody listens; a
        ``session.created`` with a new resume token (the previous one dies)."""
        kind = event.get("type")
        if kind == AUDIO_DELTA and self.detached:
            return None
        if kind == "session.created" and self.store is not None and self._holder is not None:
            token = self.store.issue(self._holder)
            if token is not None:
                event = {**event, "session": {**event["session"], "resume_token": token}}
        return event

    async def detach(self, reason: str, unsent_ms: dict[str, int]) -> None:
        """The connection dropped (``reason``, for the log): the session keeps its slot and waits
        for a resume; what was in flight is cut (``Session.connection_lost``, with the audio that
        never left the server, ``unsent_ms``)."""
        assert self.store is not None and self._holder is not None
        self.detached = True
        self._registry.detach(self.binding.id)
        self.store.detached(self._holder)
        self.log.info("%s: the session is kept for a resume (%g s)", reason, self.store.grace_s)
        await self.binding.session.connection_lost(unsent_ms)

    def attach(self) -> None:
        """A client resumed the session over a new connection."""
        self.detached = False
        self._registry.attach(self.binding.id)

    async def end(self, reason: str) -> None:
        """End the session for good (idempotent): its token and grace period go, then the
        binding releases the session and its slot."""
        holder, self._holder = self._holder, None
        if self.store is not None and holder is not None:
            self.store.forget(holder)
        await self.binding.end(reason)

    def end_soon(self, reason: str) -> None:
        """``end`` from code that cannot wait for it (a send callback)."""
        if self._ending is None:
            self._ending = asyncio.get_running_loop().create_task(self.end(reason))
