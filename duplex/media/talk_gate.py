"""Background talk kept from the VAD: the gate behind ``near_field`` noise reduction.

A noise suppressor removes what does not sound like speech; the talk of other people in a café or
an open office (babble) does, and WebRTC's suppressor, RNNoise and the VAD all keep it as speech
(measured: docs/audio_processing.md). The VAD would then start a turn in the noise alone, and no
turn would ever end. What tells a near-field caller apart from the talk around them is level: a
close-talking microphone hears its speaker well above everyone else.

So :class:`TalkGate` tells the caller's talk from the rest by level: the caller talks from
:data:`OPEN_FRAMES` frames in a row :data:`OPEN_DB` above the background's level (a low
percentile of the last :data:`HISTORY_S`, so that the caller's own words do not lift it), while
frames keep :data:`HOLD_DB` above it, and until :data:`HOLD_S` after the last such frame (the
consonants and word tails between loud vowels). Where the rest, the background, fluctuates as
talk does (the spread of its levels), the gate mutes it. A steady background (white noise, a
fan, a quiet room) is left alone: the suppressor deals with it, and nothing is muted there.

The price is at low SNR: a caller less than ~7 dB above the talk around them is muted in part
(evaluation/echo_eval.py measures WER and false turns from 0 to 20 dB). Hence ``near_field`` only
(a headset, a phone at the ear), not ``far_field``, whose talker is far from the microphone.

Ownership: one per session's front end while ``near_field`` is set; a few kB of levels; no
native state. Runs on the event loop with the front end, ~20 µs a 10 ms frame.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from duplex.media.echo_presence import level_db

FRAME_S = 0.01
HISTORY_S = 3.0  # the background's level and spread are those of the last 3 s
BACKGROUND_PERCENTILE = 20  # low: the caller's words between pauses do not lift it
# The background is talk-like where the lower part of its levels spreads this far (p40 - p5 over
# the last QUIET_HISTORY_S; 6 voices of babble ~8 dB, white noise ~1 dB): its lower part, and over
# 10 s, so that the caller's words, which a low SNR hides in it, do not make a steady noise talky.
TALKY_SPREAD_DB = 3.0
QUIET_HISTORY_S = 10.0
OPEN_DB = 10.0  # a frame this far above the background is the caller's...
OPEN_FRAMES = 3  # ...when this many come in a row (a peak of the babble is not)
HOLD_DB = 8.0  # frames this far above keep the gate open
HOLD_S = 0.25  # and it closes this long after the last of them
LEARN_EVERY = 10  # frames between two looks at the background (100 ms); every frame before
# MIN_HISTORY_S
MIN_HISTORY_S = 0.5  # a talk-like background is not known well enough before: muted until then


class TalkGate:
    """See module doc. ``process`` one 10 ms frame at a time (float32, any rate)."""

    def __init__(self) -> None:
        self._levels: deque[float] = deque(maxlen=round(HISTORY_S / FRAME_S))
        self._quiet: deque[float] = deque(maxlen=round(QUIET_HISTORY_S / FRAME_S))  # not the caller's
        self._frames = 0
        self._background: float | None = None
        # Talk until shown otherwise: the babble of a call's first 100 ms would start a turn.
        self._talky = True
        self._loud_run = 0  # frames in a row above OPEN_DB
        self._hold = 0  # frames the gate stays open for
        self._gain = 1.0  # of the last sample out (ramps over a frame: no click)
        self.muted_frames = 0  # (diagnostics, tests)

    @property
    def open(self) -> bool:
        if not self._talky:
            return True
        return self._hold > 0 and len(self._levels) >= MIN_HISTORY_S / FRAME_S

    def process(self, frame: np.ndarray, before: np.ndarray) -> np.ndarray:
        """``frame`` (the suppressor's output), muted unless the caller talks in ``before`` (the
        same 10 ms before the suppressor: it widens the spread of babble's levels, lifting its
        peaks above its lows)."""
        level = level_db(before)
        if self._background is None:
            self._background = level
        self._loud_run = self._loud_run + 1 if level > self._background + OPEN_DB else 0
        if self._loud_run >= OPEN_FRAMES or (self._hold > 0 and level > self._background + HOLD_DB):
            self._hold = round(HOLD_S / FRAME_S)
        elif self._hold > 0:
            self._hold -= 1
        self._levels.append(level)
        if not self._hold:
            self._quiet.append(level)
        self._frames += 1
        if self._frames <= MIN_HISTORY_S / FRAME_S or self._frames % LEARN_EVERY == 0:
            self._learn()  # for the next frame
        gain = 1.0 if self.open else 0.0
        if gain == self._gain == 1.0:
            return frame
        if not gain:
            self.muted_frames += 1
        ramp = np.linspace(self._gain, gain, len(frame), dtype=np.float32)
        self._gain = gain
        return frame * ramp

    def _learn(self) -> None:
        self._background = float(np.percentile(np.fromiter(self._levels, dtype=np.float64),
                                               BACKGROUND_PERCENTILE))
        if len(self._quiet) >= LEARN_EVERY:
            p5, p40 = np.percentile(np.fromiter(self._quiet, dtype=np.float64), (5, 40))
            self._talky = p40 - p5 >= TALKY_SPREAD_DB
