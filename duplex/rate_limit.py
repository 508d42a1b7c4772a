"""A token bucket: the per-connection rate limits of client events and appended audio.

One bucket per limit per connection, owned by what enforces it (the transport binding for events,
the client events for audio), living as long as the connection.
"""

from __future__ import annotations

import time


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
