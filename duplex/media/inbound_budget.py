"""Inbound media may arrive no faster than real time, with slack for jitter (DESIGN.md invariants
9 and 11).

A phone or browser sends 20 ms of audio every 20 ms; network jitter bunches packets up, and a
stalled path delivers a few seconds at once. A peer that sends ten times real time (broken, or
hostile) would otherwise have every packet decoded, resampled and run through the VAD on the event
loop every call shares. :class:`RealTimeBudget` lets a stream's media through at up to
:data:`RATE` times real time, in bursts of :data:`BURST_S` seconds, and drops the excess before it
is decoded, counting it in ``duplex_inbound_audio_dropped_seconds_total{transport}``.

One budget per inbound stream of one call (its receive path owns it), living as long as the call.
"""

from __future__ import annotations

import logging

from duplex import metrics
from duplex.rate_limit import TokenBucket

# Seconds of media a second: real time, and half again for a peer catching up after jitter.
RATE = 1.5
# A stall of a few seconds delivered at once (a jitter buffer's worth and more) passes whole.
BURST_S = 2.0


class RealTimeBudget:
    """See module doc. ``log`` carries the call's or session's id."""

    def __init__(self, transport: str, log: logging.Logger | logging.LoggerAdapter) -> None:
        self._bucket = TokenBucket(RATE, BURST_S)
        self._dropped = metrics.INBOUND_AUDIO_DROPPED_SECONDS.labels(transport)
        self._log = log
        self._dropping = False  # logged once per spell of dropping, not per packet

    def admit(self, seconds: float) -> bool:
        """Whether ``seconds`` of media that just arrived may be decoded; the excess is counted."""
        if self._bucket.take(seconds):
            if self._dropping:
                self._dropping = False
                self._log.info("inbound media back within real time")
            return True
        self._dropped.inc(seconds)
        if not self._dropping:
            self._dropping = True
            self._log.warning("inbound media arrives faster than %.1f× real time: dropping the excess",
                              RATE)
        return False
