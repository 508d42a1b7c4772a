"""Where a session's agent audio goes: the AgentAudio contract and its two implementations.

- ``PacedPlayout`` (WebRTC): the server paces the audio out itself (``OutboundAudioTrack``), so it
  knows exactly what the user heard, and can pause, resume and clear it at the next 20 ms frame.
- ``ClientPlayout`` (Realtime WebSocket): the audio leaves as ``response.output_audio.delta`` events
  and the client plays it; the server only counts what it sent (the client truncates).

Each belongs to one session and lives as long as it; per-item counters are dropped by ``release``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from duplex.audio import Resampler, webrtc_outbound
from duplex.outbound import OutboundAudioTrack


class AgentAudio(Protocol):
    paces_playout: bool
    """True when the server plays the audio out in real time and knows what was heard."""

    def play(self, item_id: str, samples: np.ndarray, sample_rate: int) -> None:
        """Queue float32 mono samples of ``item_id`` after everything queued."""

    def end_item(self, item_id: str) -> None:
        """No more audio for ``item_id``: queue what the resampler still holds."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def clear(self) -> None:
        """Drop everything queued (a confirmed interruption)."""

    def heard_ms(self, item_id: str) -> int:
        """Milliseconds of ``item_id`` played out (paced) or sent (client playout)."""

    def queued_seconds(self) -> float: ...

    def release(self, item_id: str) -> None: ...


class PacedPlayout:
    paces_playout = True

    def __init__(self, track: OutboundAudioTrack) -> None:
        self.track = track
        self._resampler: Resampler | None = None

    def _resample(self, samples: np.ndarray, sample_rate: int) -> np.ndarray:
        if self._resampler is None or self._resampler.in_rate != sample_rate:
            self._resampler = webrtc_outbound(sample_rate)
        return self._resampler.push(samples)

    def play(self, item_id: str, samples: np.ndarray, sample_rate: int) -> None:
        self.track.enqueue(item_id, self._resample(samples, sample_rate))

    def end_item(self, item_id: str) -> None:
        if self._resampler is not None:
            self.track.enqueue(item_id, self._resampler.flush())
        self.track.end_item(item_id)

    def pause(self) -> None:
        self.track.pause()

    def resume(self) -> None:
        self.track.resume()

    def clear(self) -> None:
        self.track.flush()
        if self._resampler is not None:
            self._resampler.flush()

    def heard_ms(self, item_id: str) -> int:
        return self.track.sent_ms(item_id)

    def queued_seconds(self) -> float:
        return self.track.queued_seconds

    def release(self, item_id: str) -> None:
        self.track.release(item_id)


class ClientPlayout:
    paces_playout = False

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}  # item_id -> ms sent

    def play(self, item_id: str, samples: np.ndarray, sample_rate: int) -> None:
        self._sent[item_id] = self._sent.get(item_id, 0) + len(samples) * 1000 // sample_rate

    def end_item(self, item_id: str) -> None:
        """Nothing is held back: every chunk was sent as it came."""

    def pause(self) -> None:
        """The client owns playback: it stops it on ``speech_started``."""

    def resume(self) -> None:
        """The client owns playback."""

    def clear(self) -> None:
        """Nothing is queued on the server."""

    def heard_ms(self, item_id: str) -> int:
        return self._sent.get(item_id, 0)

    def queued_seconds(self) -> float:
        return 0.0

    def release(self, item_id: str) -> None:
        self._sent.pop(item_id, None)
