"""When each recent chunk of a session's inbound audio arrived, to time what the audio caused.

Turn-taking runs on audio time (positions in the inbound stream); the barge-in metric needs wall
time: from the arrival of the audio that holds a speech onset to the agent's silence, so the VAD's
own delay counts. An :class:`Arrivals` belongs to one session and keeps the last
:data:`ARRIVALS_KEPT` chunks only.
"""

from __future__ import annotations

from collections import deque

from duplex.turns.vad import SAMPLE_RATE

ARRIVALS_KEPT = 256  # ~5 s of 20 ms chunks: more than the VAD ever lags behind


class Arrivals:
    def __init__(self) -> None:
        self._chunks: deque[tuple[int, float]] = deque(maxlen=ARRIVALS_KEPT)  # (end sample, when)
        self._received = 0

    def note(self, samples: int, at: float) -> None:
        """A chunk of ``samples`` arrived at monotonic time ``at``."""
        self._received += samples
        self._chunks.append((self._received, at))

    def of(self, position_ms: int, fallback: float) -> float:
        """When the chunk holding ``position_ms`` of the stream arrived (``fallback`` if forgotten)."""
        sample = position_ms * SAMPLE_RATE // 1000
        return next((at for end, at in self._chunks if end > sample), fallback)
