"""server_vad turn detection for one session, on a streaming VAD.

:class:`TurnDetector` runs a :class:`~duplex.turns.vad.VadStream` over 16 kHz mono float32 audio fed
in chunks of any length, one 512-sample (32 ms) window at a time, and turns the per-window speech
probability into turn events with the parameters of a :class:`~duplex.turns.config.TurnDetection`:

- :class:`SpeechStarted` at the first window whose probability reaches the threshold; ``start_ms``
  is where that window begins in the input stream (the real onset), ``padded_start_ms`` where the
  turn's audio begins (``prefix_padding_ms`` earlier, never before the previous turn's end);
- :class:`SpeechStopped` once ``silence_duration_ms`` of silence followed the speech, carrying the
  turn's audio from ``padded_start_ms`` to the point the turn was closed (trailing silence
  included, as OpenAI commits it). A turn that reaches ``max_turn_ms`` is closed there (``forced``).

Speech stays on, once started, while the probability stays at or above ``threshold - 0.15``:
silero's own streaming iterator uses that hysteresis, so a probability that wavers around the
threshold inside a word does not start the silence count.

Time is the audio: every position is a sample count of the input stream since the last
:meth:`TurnDetector.reset`, reported in ms. Nothing reads a clock, so the same audio always gives
the same events, however it is chunked.

State: a detector belongs to one session and holds that session's VAD stream, a partial window, a
prefix ring of ``prefix_padding_ms`` and, during a turn, the turn's audio (at most ``max_turn_ms``).
:meth:`TurnDetector.reset` releases all of it; the session calls it when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from duplex.turns.config import TurnDetection
from duplex.turns.vad import SAMPLE_RATE, WINDOW, VadStream

HYSTERESIS = 0.15  # speech continues down to threshold - HYSTERESIS (silero's VADIterator)


@dataclass(frozen=True)
class SpeechStarted:
    start_ms: int  # onset: start of the first window at or above the threshold
    padded_start_ms: int  # where the turn's audio begins


@dataclass(frozen=True)
class SpeechStopped:
    start_ms: int
    padded_start_ms: int
    speech_end_ms: int  # end of the last window that was still speech
    end_ms: int  # where the turn was closed; the audio ends here
    audio: np.ndarray = field(repr=False)  # float32 16 kHz, [padded_start_ms, end_ms)
    forced: bool = False  # closed by max_turn_ms rather than by silence


TurnEvent = SpeechStarted | SpeechStopped


def _ms(samples: int) -> int:
    return samples * 1000 // SAMPLE_RATE


def _samples(ms: int) -> int:
    return ms * SAMPLE_RATE // 1000


class TurnDetector:
    """Streaming silero-vad plus server_vad turn detection for one session (see module doc).

    ``config`` may be replaced at any time (``session.update``); ``threshold_override``, when set,
    replaces ``config.threshold`` (the session's echo guard while the agent's speech is young).
    Both take effect from the next window.
    """

    def __init__(self, config: TurnDetection | None = None, max_turn_ms: int = 120_000) -> None:
        self.config = config or TurnDetection()
        self.max_turn_ms = max_turn_ms
        self.threshold_override: float | None = None
        self.reset()

    def reset(self) -> None:
        """Forget everything: model state, position, buffered audio (the session ended)."""
        self._vad = VadStream()
        self._pending = np.zeros(0, dtype=np.float32)  # < WINDOW samples not yet inferred
        self._position = 0  # samples inferred so far
        self._probability = 0.0
        self._prefix = np.zeros(0, dtype=np.float32)  # audio before a turn, ≤ prefix padding
        self._prefix_start = 0  # sample position of self._prefix[0]
        self._turn: list[np.ndarray] = []  # the current turn's audio, prefix included
        self._start = -1  # onset sample of the current turn; -1 when idle
        self._speech_end = 0  # end sample of the last speech window of the current turn

    @property
    def threshold(self) -> float:
        return self.config.threshold if self.threshold_override is None else self.threshold_override

    @property
    def in_speech(self) -> bool:
        return self._start >= 0

    @property
    def position_ms(self) -> int:
        """How much audio has been inferred (the partial window held back is not counted)."""
        return _ms(self._position)

    @property
    def probability(self) -> float:
        """Speech probability of the last window."""
        return self._probability

    @property
    def speech_ms(self) -> int:
        """Onset to the end of the last speech window of the current turn (0 when idle)."""
        return _ms(self._speech_end - self._start) if self.in_speech else 0

    @property
    def silence_ms(self) -> int:
        """Silence since the last speech window of the current turn (0 when idle)."""
        return _ms(self._position - self._speech_end) if self.in_speech else 0

    def process(self, samples: np.ndarray) -> list[TurnEvent]:
        """Feed 16 kHz mono float32 audio of any length; returns the turn events it completed."""
        audio = np.concatenate([self._pending, np.asarray(samples, dtype=np.float32)])
        windows = len(audio) // WINDOW
        events: list[TurnEvent] = []
        for i in range(windows):
            event = self._window(audio[i * WINDOW : (i + 1) * WINDOW])
            if event is not None:
                events.append(event)
        self._pending = audio[windows * WINDOW :].copy()
        return events

    @property
    def pause_start(self) -> int:
        """Where the current pause began (the end of the last speech window), in samples."""
        return self._speech_end

    @property
    def turn_start(self) -> int:
        """Where the current turn's audio begins (its padded start), in samples."""
        return self._prefix_start

    @property
    def turn_samples(self) -> int:
        """How long the current turn's audio is so far (``len(turn_audio())``, without the copy)."""
        return self._position - self._prefix_start if self.in_speech else 0

    def turn_audio(self) -> np.ndarray:
        """The current turn's audio so far, prefix and trailing silence included (a copy)."""
        return np.concatenate(self._turn) if self._turn else np.zeros(0, dtype=np.float32)

    def end_turn(self) -> SpeechStopped | None:
        """Close the current turn here (a semantic decision); None when no turn is open."""
        return self._stop(forced=False) if self.in_speech else None

    def discard_turn(self) -> None:
        """Drop the current turn without an event (a false interruption, a cleared buffer)."""
        self._close_turn()

    def _window(self, window: np.ndarray) -> TurnEvent | None:
        self._probability = self._vad.probability(window)
        begin = self._position
        self._position += WINDOW
        if not self.in_speech:
            if self._probability >= self.threshold:
                return self._open_turn(begin, window)
            self._keep_prefix(window)
            return None
        self._turn.append(window)
        if self._probability >= self.threshold - HYSTERESIS:
            self._speech_end = self._position
        # semantic_vad: the session's SemanticTurnJudge ends the turn (``end_turn``), not silence.
        if (self.config.type == "server_vad"
                and self._position - self._speech_end >= _samples(self.config.silence_duration_ms)):
            return self._stop(forced=False)
        if self._position - self._prefix_start >= _samples(self.max_turn_ms):
            return self._stop(forced=True)
        return None

    def _keep_prefix(self, window: np.ndarray) -> None:
        keep = _samples(self.config.prefix_padding_ms)
        prefix = np.concatenate([self._prefix, window])
        dropped = max(len(prefix) - keep, 0)
        self._prefix = prefix[dropped:]
        self._prefix_start += dropped

    def _open_turn(self, begin: int, window: np.ndarray) -> SpeechStarted:
        self._start = begin
        self._speech_end = self._position
        self._turn = [self._prefix, window]
        return SpeechStarted(start_ms=_ms(begin), padded_start_ms=_ms(self._prefix_start))

    def _stop(self, forced: bool) -> SpeechStopped:
        event = SpeechStopped(
            start_ms=_ms(self._start),
            padded_start_ms=_ms(self._prefix_start),
            speech_end_ms=_ms(self._speech_end),
            end_ms=_ms(self._position),
            audio=np.concatenate(self._turn),
            forced=forced,
        )
        self._close_turn()
        return event

    def _close_turn(self) -> None:
        # The next turn's prefix starts here, so consecutive turns never share audio.
        self._start = -1
        self._turn = []
        self._prefix = np.zeros(0, dtype=np.float32)
        self._prefix_start = self._position
