"""The far end of a session's echo canceller: the agent's audio as the caller heard it, on a clock.

An acoustic echo canceller needs, beside what the microphone picked up (the near end), what the
loudspeaker played (the far end), and when. The server knows both: every transport reports the
agent's audio to its AgentAudio's *tap* (:class:`~duplex.media.playout.AudioTap`) at the moment
the caller hears it, on the transport's own clock:

- paced transports (WebRTC, SIP): each 20 ms frame as the paced sender takes it
  (``agent_played``);
- Twilio: each chunk as it starts playing, when the mark of the one before it comes back
  (``duplex/media/marked_playout.py``);
- the Realtime WebSocket: each chunk as it is sent; the client plays it after what it already has
  (``agent_sent``), so chunks are laid out one after the other from their sending, as
  ``duplex/media/recording.py`` lays them out, and cut where the client stopped playing
  (``cut_agent``, at ``input_audio_buffer.speech_started``): else the canceller would take the
  answer's unplayed rest for an echo still to come and suppress the caller's words under it.

:class:`FarEnd` is such a tap. It resamples what it is told to 16 kHz and lays it on a timeline of
sample positions (``(time - start) * 16000`` on the monotonic clock), kept continuous across the
jitter of the reports (:data:`JITTER_S`); :meth:`FarEnd.read` gives any 10 ms stretch of it
(silence where nothing played). It passes every report on to ``downstream`` (a call's recording),
so that one AgentAudio tap serves both.

Ownership: one per session, owned by its :class:`~duplex.media.front_end.AudioFrontEnd`; it holds
at most :data:`KEEP_S` of audio behind the near end's position (``forget``) and at most
:data:`MAX_AHEAD_S` of a fast client's audio ahead of the clock, and drops everything at ``close``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np

from duplex.media.playout import AudioTap
from duplex.media.resample import Resampler

RATE = 16000
JITTER_S = 0.1  # a report this much early or late still continues the one before it
KEEP_S = 1.0  # far-end audio kept behind the near end: the echo canceller reaches ~0.5 s back
MAX_AHEAD_S = 60.0  # a client's audio scheduled ahead of the clock, at most


class FarEnd:
    """See module doc. Every method runs on the event loop and never blocks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.downstream: AudioTap | None = None
        """Told everything this tap is told, after it (the binding's call recording, if any)."""
        self._clock = clock
        self._start = clock()
        self._segments: deque[tuple[int, np.ndarray]] = deque()  # (start position, float32 16 kHz)
        self._end = 0  # position after the last sample laid out
        self._resamplers: dict[tuple[int, str], Resampler] = {}

    def pos(self, at: float) -> int:
        """The timeline position of monotonic time ``at``."""
        return round((at - self._start) * RATE)

    # --- AudioTap ---------------------------------------------------------------------------

    def agent_played(self, samples: np.ndarray, rate: int, at: float) -> None:
        """The caller heard ``samples`` from ``at`` on."""
        audio = self._resample(samples, rate)
        start = self.pos(at)
        if abs(start - self._end) <= JITTER_S * RATE or start < self._end:
            start = self._end  # continuous with what played before it
        self._lay(start, audio)
        if self.downstream is not None:
            self.downstream.agent_played(samples, rate, at)

    def agent_sent(self, samples: np.ndarray, rate: int, at: float) -> None:
        """``samples`` were sent at ``at``; the client plays them after what it already has."""
        audio = self._resample(samples, rate)
        start = max(self.pos(at), self._end)
        if start - self.pos(self._clock()) <= MAX_AHEAD_S * RATE:
            self._lay(start, audio)
        if self.downstream is not None:
            self.downstream.agent_sent(samples, rate, at)

    def cut_agent(self, at: float) -> None:
        """The client stopped playing at ``at``: what was laid out after it is dropped."""
        cut = self.pos(at)
        kept = [(start, audio[: cut - start]) for start, audio in self._segments if start < cut]
        self._segments = deque((start, audio) for start, audio in kept if len(audio))
        self._end = min(self._end, cut)
        if self.downstream is not None:
            self.downstream.cut_agent(at)

    # --- the canceller's side ----------------------------------------------------------------

    @property
    def end(self) -> int:
        """The position after the last far-end sample laid out (0: nothing ever played)."""
        return self._end

    def playing(self, start: int, stop: int) -> bool:
        """Whether any far-end audio lies between positions ``start`` and ``stop``."""
        return any(seg_start < stop and seg_start + len(audio) > start
                   for seg_start, audio in self._segments)

    def read(self, start: int, count: int) -> np.ndarray:
        """The far end from position ``start`` on, ``count`` samples (silence where none played)."""
        out = np.zeros(count, dtype=np.float32)
        stop = start + count
        for seg_start, audio in self._segments:
            seg_stop = seg_start + len(audio)
            if seg_start >= stop:
                break
            if seg_stop <= start:
                continue
            lo, hi = max(start, seg_start), min(stop, seg_stop)
            out[lo - start : hi - start] = audio[lo - seg_start : hi - seg_start]
        return out

    def forget(self, before: int) -> None:
        """Drop what ended more than :data:`KEEP_S` before position ``before``."""
        horizon = before - int(KEEP_S * RATE)
        while self._segments and self._segments[0][0] + len(self._segments[0][1]) < horizon:
            self._segments.popleft()

    def close(self) -> None:
        """The session closed: drop the audio, the resamplers and the downstream tap."""
        self._segments.clear()
        self._resamplers.clear()
        self.downstream = None

    # --- helpers ----------------------------------------------------------------------------

    def _lay(self, start: int, audio: np.ndarray) -> None:
        if len(audio):
            self._segments.append((start, audio))
            self._end = start + len(audio)

    def _resample(self, samples: np.ndarray, rate: int) -> np.ndarray:
        samples = np.asarray(samples)
        if samples.dtype == np.int16:
            samples = samples.astype(np.float32) / 32768.0
        samples = samples.astype(np.float32, copy=False)
        if rate == RATE:
            return samples.copy()
        key = (rate, samples.dtype.str)
        resampler = self._resamplers.get(key)
        if resampler is None:
            resampler = self._resamplers[key] = Resampler(rate, RATE)
        return resampler.push(samples)

