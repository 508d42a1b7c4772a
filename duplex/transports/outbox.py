"""Server events on their way to a client that is not taking them now, bounded in bytes.

An :class:`Outbox` belongs to one connection object (the WebSocket's, a WebRTC call's) and lives as
long as it. It holds JSON text events, in the order the session sent them: the WebSocket's writer
takes them one at a time as the socket accepts them (and a :class:`Closing` queued after the events
that must go out first); a WebRTC call keeps here what it cannot send yet (its events channel not
open, or no peer at all while the session waits for a resume) and sends it all once a channel opens.
A session that waits for its client to resume it (docs/resume.md) takes what it held with
:meth:`Outbox.take` and sends it on the new connection.

The bound is the same for every transport and for both reasons events pile up (a client that does
not read, a client that is gone): past :data:`MAX_UNSENT_BYTES`, :meth:`Outbox.put` refuses the
event, and the connection ends its session rather than let its memory grow.
"""

from __future__ import annotations

import asyncio

from duplex.transports.binding import Closing

# A second of agent audio is ~64 kB of WebSocket events, so this is minutes of a client that only
# lags, and far more than the events (audio aside) of a session waiting for a resume.
MAX_UNSENT_BYTES = 8 * 1024 * 1024


class Outbox:
    """See module doc. Not thread-safe: used on the event loop only."""

    def __init__(self, limit: int = MAX_UNSENT_BYTES) -> None:
        self.limit = limit
        self._queue: asyncio.Queue[str | Closing] = asyncio.Queue()
        self._bytes = 0  # of the events in the queue

    def __len__(self) -> int:
        return self._queue.qsize()

    def put(self, text: str) -> bool:
        """Queue ``text``; False (nothing queued) where it would pass the bound."""
        if self._bytes + len(text) > self.limit:
            return False
        self._bytes += len(text)
        self._queue.put_nowait(text)
        return True

    def close_after(self, closing: Closing) -> None:
        """Queue the end of the connection, after the events already queued."""
        self._queue.put_nowait(closing)

    async def get(self) -> str | Closing:
        """The next event (or the Closing), once there is one."""
        item = await self._queue.get()
        if isinstance(item, str):
            self._bytes -= len(item)
        return item

    def take(self) -> list[str]:
        """Empty the outbox; returns the events it held, in order (a Closing is dropped: it was
        queued for a connection that is gone)."""
        held: list[str] = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, str):
                held.append(item)
        self._bytes = 0
        return held
