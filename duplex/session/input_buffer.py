"""The input audio buffer of manual turns (turn detection off): what the client appended and has
not committed yet, bounded by the longest turn. Belongs to one session; cleared by it."""

from __future__ import annotations

import numpy as np

from duplex.protocol.events import RealtimeError


class InputBuffer:
    def __init__(self, max_seconds: float, rate: int) -> None:
        self._max_seconds = max_seconds
        self._limit = int(max_seconds * rate)
        self._chunks: list[np.ndarray] = []
        self._samples = 0

    def append(self, samples: np.ndarray) -> None:
        """Add audio; refuses (RealtimeError) what would pass the longest turn."""
        if self._samples + len(samples) > self._limit:
            raise RealtimeError(f"the input audio buffer is full ({self._max_seconds:.0f} s)",
                                code="input_audio_buffer_full")
        self._chunks.append(np.asarray(samples, dtype=np.float32))
        self._samples += len(samples)

    def take(self) -> np.ndarray:
        """Everything appended, emptying the buffer; RealtimeError when there is nothing."""
        if not self._chunks:
            raise RealtimeError("the input audio buffer is empty", code="input_audio_buffer_commit_empty")
        audio = np.concatenate(self._chunks)
        self.clear()
        return audio

    def clear(self) -> None:
        self._chunks.clear()
        self._samples = 0
