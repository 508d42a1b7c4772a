"""Token buckets: the per-connection rate limits of client events and appended audio, and the
per-address limit on new sessions.

One bucket per limit per connection, owned by what enforces it (the transport binding for events,
the client events for audio), living as long as the connection; :class:`PerClient` keeps one per
client address for the server's life.
"""

from __future__ import annotations

import time
from collections import OrderedDict


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` held; each use takes what it costs."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self._at = time.monotonic()

    def take(self, amount: float = 1.0) -> bool:
        """Take ``amount`` tokens if there are that many (after refilling for the time since the
        last call)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate)
        self._at = now
        if self.tokens < amount:
            return False
        self.tokens -= amount
        return True

    def penalize(self, seconds: float) -> None:
        """Empty the bucket and hold it empty for ``seconds`` more (what it refills in that time
        is owed first)."""
        self.take(0.0)
        self.tokens = min(self.tokens, 0.0) - seconds * self.rate


class PerClient:
    """A :class:`TokenBucket` per client address, for what each client may do across its
    connections (start new Realtime WebSocket sessions, send their events): the least recently
    seen addresses are forgotten past ``max_clients``. One per server, for its whole life."""

    def __init__(self, rate: float, burst: float, max_clients: int = 4096) -> None:
        self._rate = rate
        self._burst = burst
        self._max_clients = max_clients
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, address: str) -> bool:
        return self.bucket(address).take()

    def bucket(self, address: str) -> TokenBucket:
        """The address's bucket (shared by everything the address does that this one limits)."""
        bucket = self._buckets.pop(address, None) or TokenBucket(self._rate, self._burst)
        self._buckets[address] = bucket
        while len(self._buckets) > self._max_clients:
            self._buckets.popitem(last=False)
        return bucket
