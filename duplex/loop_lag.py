"""The event loop's lag (``duplex_event_loop_lag_seconds``): a task that sleeps 100 ms at a time
and records how late each wake-up comes.

Everything real-time on the server (paced audio, VAD, every client's events) shares one event
loop; work that holds it (a bulk decode, a parse of a huge message) delays them all by exactly
this lag. One sampler per server, started at start-up and cancelled at shutdown.
"""

from __future__ import annotations

import asyncio
import time

from duplex import metrics

PERIOD_S = 0.1


async def sample_lag(period_s: float = PERIOD_S) -> None:
    """Record each timer's lateness until cancelled."""
    while True:
        due = time.monotonic() + period_s
        await asyncio.sleep(period_s)
        metrics.EVENT_LOOP_LAG_SECONDS.observe(max(0.0, time.monotonic() - due))
