"""Admission and bookkeeping of live sessions across every transport (``--max-sessions``).

The registry lives as long as the server. A session holds its slot from ``admit`` until
``release`` (idempotent); ``close_all`` ends every session at shutdown.
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


class SessionRegistry:
    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._slots: dict[str, SessionSlot] = {}

    def check_room(self) -> None:
        """Raise TooManySessions when no slot is free: a transport asks before it builds a
        session (VAD state, buffers) that a refusal would only throw away."""
        if len(self._slots) >= self.max_sessions:
            raise TooManySessions(f"the server is at its limit of {self.max_sessions} sessions")

    def admit(self, slot: SessionSlot) -> None:
        self.check_room()
        self._slots[slot.session_id] = slot
        metrics.SESSIONS_ACTIVE.labels(slot.transport).inc()
        metrics.SESSIONS_TOTAL.labels(slot.transport).inc()
        log.info("session %s admitted (%s); %d live", slot.session_id, slot.transport, len(self._slots))

    def release(self, session_id: str) -> None:
        slot = self._slots.pop(session_id, None)
        if slot is not None:
            metrics.SESSIONS_ACTIVE.labels(slot.transport).dec()
            log.info("session %s released; %d live", session_id, len(self._slots))

    def get(self, session_id: str) -> SessionSlot | None:
        return self._slots.get(session_id)

    def queued_seconds(self) -> float:
        return sum(slot.queued_seconds() for slot in self._slots.values())

    def __len__(self) -> int:
        return len(self._slots)

    async def close_all(self) -> None:
        await asyncio.gather(*(slot.close() for slot in list(self._slots.values())), return_exceptions=True)
