"""An endpoint's received messages in two lanes: the abort path first, then everything else.

Abort-to-clear has a 20 ms budget (DESIGN.md), and a stage saturated with data would otherwise
handle an Abort only after every data message queued before it. Aborts and their acknowledgements
ride the urgent lane and overtake what waits in the other; order is kept within each lane.
Overtaking is safe: a stage marks an aborted request gone, so the data it skipped is dropped when
its turn comes (and the coordinator drops chunks of an ended request), never recreating state.

Owned by one endpoint on one event loop for the endpoint's life, with one consumer (the owner of
the endpoint, through ``recv``); it holds a message from its arrival until ``get`` hands it out.
"""

from __future__ import annotations

import asyncio
from collections import deque

from pipeline.proto import Abort, AbortAck, ControlMessage
from pipeline.transport.base import ReaderDied

URGENT = (Abort, AbortAck)
"""Message types of the urgent lane."""


class Inbox:
    def __init__(self) -> None:
        self._urgent: deque[ControlMessage] = deque()
        self._other: deque[ControlMessage] = deque()
        self._failure: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, message: ControlMessage) -> None:
        (self._urgent if isinstance(message, URGENT) else self._other).append(message)
        self._wake()

    def fail(self, error: BaseException) -> None:
        """The reader feeding this inbox died: the next ``get`` raises ReaderDied (what arrived
        is kept for the ``get`` after it)."""
        self._failure = error
        self._wake()

    async def get(self) -> ControlMessage:
        while True:
            # First: a busy inbox may never run empty, and the owner must learn of the failure.
            if self._failure is not None:
                failure, self._failure = self._failure, None
                raise ReaderDied(f"socket reader failed: {failure!r}") from failure
            if self._urgent:
                return self._urgent.popleft()
            if self._other:
                return self._other.popleft()
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
