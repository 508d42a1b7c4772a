"""Admission and bookkeeping of live sessions across every transport (``--max-sessions``).

The registry lives as long as the server. A session holds its slot from ``admit`` until
``release`` (idempotent), including while it has no connection and waits for its client to resume
it (``detach`` … ``attach``, docs/resume.md): such a session counts against the limit, and
``duplex_sessions_awaiting_resume`` counts it. A session about to start (a SIP call ringing while
the app decides, a call being placed) holds a slot from ``hold`` until ``unhold`` (idempotent),
which its transport calls as the session is admitted or the call ends unanswered: no session of
another transport can take that slot meanwhile (``duplex_sessions_held``). ``close_all`` ends
every session at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from duplex import metrics

log = logging.getLogger(__name__)


class TooManySessions(RuntimeError):
    """The server is at ``max_sessions``; the client should retry later."""

    retry_after_s = 5


@dataclass
class SessionSlot:
    session_id: str
    transport: str
    close: Callable[[], Awaitable[None]]
    queued_seconds: Callable[[], float] = lambda: 0.0  # agent audio waiting for playout
    detached: bool = False  # no connection: waiting for a resume


class SessionRegistry:
    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._slots: dict[str, SessionSlot] = {}
        self._held: dict[str, str] = {}  # key -> transport: slots held for sessions about to start

    def check_room(self) -> None:
        """Raise TooManySessions when no slot is free (held ones are not): a transport asks
        before it builds a session (VAD state, buffers) that a refusal would only throw away."""
        if len(self._slots) + len(self._held) >= self.max_sessions:
            raise TooManySessions(f"the server is at its limit of {self.max_sessions} sessions")

    def hold(self, key: str, transport: str) -> None:
        """Hold a slot for a session about to start (module doc); raises TooManySessions."""
        self.check_room()
        self._held[key] = transport
        metrics.SESSIONS_HELD.labels(transport).inc()

    def unhold(self, key: str) -> None:
        """The held slot is free again: its session is being admitted, or will never start."""
        transport = self._held.pop(key, None)
        if transport is not None:
            metrics.SESSIONS_HELD.labels(transport).dec()

    @property
    def held(self) -> int:
        return len(self._held)

    def admit(self, slot: SessionSlot) -> None:
        self.check_room()
        self._slots[slot.session_id] = slot
        metrics.SESSIONS_ACTIVE.labels(slot.transport).inc()
        metrics.SESSIONS_TOTAL.labels(slot.transport).inc()
        log.info("session %s admitted (%s); %d live", slot.session_id, slot.transport, len(self._slots))

    def release(self, session_id: str) -> None:
        slot = self._slots.pop(session_id, None)
        if slot is not None:
            self._attached(slot)
            metrics.SESSIONS_ACTIVE.labels(slot.transport).dec()
            log.info("session %s released; %d live", session_id, len(self._slots))

    def detach(self, session_id: str) -> None:
        """The session's connection dropped: it keeps its slot while it waits for a resume."""
        slot = self._slots.get(session_id)
        if slot is not None and not slot.detached:
            slot.detached = True
            metrics.SESSIONS_AWAITING_RESUME.labels(slot.transport).inc()

    def attach(self, session_id: str) -> None:
        """The session has a connection again (resumed)."""
        slot = self._slots.get(session_id)
        if slot is not None:
            self._attached(slot)

    @staticmethod
    def _attached(slot: SessionSlot) -> None:
        if slot.detached:
            slot.detached = False
            metrics.SESSIONS_AWAITING_RESUME.labels(slot.transport).dec()

    def get(self, session_id: str) -> SessionSlot | None:
        return self._slots.get(session_id)

    def queued_seconds(self) -> float:
        return sum(slot.queued_seconds() for slot in self._slots.values())

    def __len__(self) -> int:
        return len(self._slots)

    async def close_all(self) -> None:
        await asyncio.gather(*(slot.close() for slot in list(self._slots.values())), return_exceptions=True)
