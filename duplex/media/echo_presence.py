"""Whether the agent's echo is in the caller's audio at all: the gate in front of AEC3's output.

WebRTC's AEC3 suppresses the near end wherever it expects echo, and until its delay estimator has
locked onto an echo path it expects one wherever the far end is loud. On a line with no echo (a
headset, a browser that cancelled it already) it never locks, and the caller's words over the
agent lose 10 to 35 dB in their first 400 ms (measured: docs/audio_processing.md): barge-in would
wait seconds. So the front end uses AEC3's output only while an echo is there, and passes the
caller's audio (delayed as AEC3 delays it) otherwise.

The evidence: the echo follows the far end's loudness, some delay later. Every
:data:`EVERY` frames, the log-energy envelope of the last :data:`WINDOW` 10 ms frames of the near
end is correlated with the far end's at each lag from 0 to :data:`MAX_LAG` frames (600 ms, the
canceller's reach); the best correlation switches the echo on at :data:`ON` and off below
:data:`OFF` (hysteresis). While either side is flat (silence) nothing is learnt and the state
holds: the same phone on the same table echoes the next answer too. One exception: a far end
that plays a steady sound (a tone, whose loudness does not move: the toy preset's voice, hold
music's sustained notes) has a steady echo too, so a near end whose loudness moves meanwhile is the
caller's and no echo: "none" (AEC3 would otherwise suppress the caller for as long as it plays),
once the far end has been steady over all the window's lags (2.6 s: before, its start is a step
that the caller's first words, another step, follow closely enough to look like its echo). It starts as "echo": the first
answer's echo is cancelled from its first frame, and a line without echo shows itself as soon as
the caller speaks over the agent. This estimates nothing but a yes or no;
the cancelling is AEC3's.

Ownership: one per echo canceller (so per session), about 4 kB of envelopes, freed with it.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

WINDOW = 200  # frames (2 s) of envelope correlated
MAX_LAG = 60  # frames (600 ms): the echo delays AEC3 covers, and a little more
EVERY = 5  # frames between decisions (50 ms)
ON, OFF = 0.5, 0.25  # best correlation that says "echo", and below which it says "none"
FLOOR_DB = -90.0
MIN_SPREAD_DB = 3.0  # an envelope flatter than this (silence) is no evidence
STEADY_DB = -60.0  # a flat far end above this level is a steady sound, not silence


_FLOOR = 10 ** (FLOOR_DB / 10)


def level_db(frame: np.ndarray) -> float:
    """The frame's mean power in dB (full scale 0 dB), floored at :data:`FLOOR_DB`."""
    return 10 * math.log10(float(np.dot(frame, frame)) / len(frame) + _FLOOR)


class EchoPresence:
    """See module doc. ``update`` once per 10 ms frame, with the far end of the same moment."""

    def __init__(self) -> None:
        self._far = np.full(WINDOW + MAX_LAG, FLOOR_DB)
        self._near = np.full(WINDOW, FLOOR_DB)
        self._frames = 0
        # Until the first evidence, a speakerphone: its echo would otherwise pass while the
        # evidence gathers (the agent's first 100-200 ms, enough for the VAD to hear itself);
        # a line without echo is told by the caller's first words over the agent (~50 ms).
        self.present = True
        self.correlation = 0.0  # the best one at the last decision (diagnostics)

    def update(self, far: np.ndarray, near: np.ndarray) -> bool:
        """Note one frame of each side; whether the echo is there (as of the last decision)."""
        self._far[:-1] = self._far[1:]
        self._far[-1] = level_db(far)
        self._near[:-1] = self._near[1:]
        self._near[-1] = level_db(near)
        self._frames += 1
        if self._frames % EVERY == 0:
            self._decide()
        return self.present

    def _decide(self) -> None:
        near = self._near - self._near.mean()
        if np.ptp(self._near) < MIN_SPREAD_DB:
            return  # the caller's side is flat: no echo to see, and no word to protect either
        fars = sliding_window_view(self._far, WINDOW)  # row k: the far end MAX_LAG - k frames ago
        spread = np.ptp(fars, axis=1)
        if spread.max() < MIN_SPREAD_DB:
            if self._far.min() > STEADY_DB:  # a steady sound: what moves in the near end is the caller
                self.correlation = 0.0
                self.present = False
            return  # else the agent was silent: nothing learnt, the state holds
        centred = fars - fars.mean(axis=1, keepdims=True)
        norms = np.linalg.norm(centred, axis=1) * np.linalg.norm(near)
        corr = np.where(norms > 0, centred @ near / np.maximum(norms, 1e-12), 0.0)
        self.correlation = float(corr.max())
        if self.correlation >= ON:
            self.present = True
        elif self.correlation < OFF:
            self.present = False
