"""Prosodic end-of-turn cue: how far the pitch falls over the last words before a pause.

A speaker who has finished a statement lowers their pitch over the last word or two ("final
lowering"); one who pauses mid-phrase, or between the groups of a phone number, keeps it level or
raises it to hold the floor. :func:`final_pitch_fall` measures that on the audio up to a pause: the
log ratio of the pitch over the last third of the voiced frames in the final ``SPAN_MS`` of speech
to the pitch over the first third. Negative means falling. Questions with a rising end read as
level or rising, so this cue only ever adds evidence that a turn ended, never removes it (see
:mod:`duplex.turns.end_of_turn`).

Pitch is found per 40 ms frame (10 ms hop) by autocorrelation between 70 and 400 Hz: cheap
(~3 ms for a pause) and good enough for a slope, where an octave error in one frame is outvoted
by the medians.

Nothing here holds state.
"""

from __future__ import annotations

import numpy as np

SAMPLE_RATE = 16000
SPAN_MS = 600  # speech before the pause that the slope is measured over
_FRAME = 640  # 40 ms: two periods of the lowest pitch searched
_HOP = 160  # 10 ms
_MIN_LAG = SAMPLE_RATE // 400  # 400 Hz
_MAX_LAG = SAMPLE_RATE // 70  # 70 Hz
_VOICED = 0.4  # autocorrelation peak / energy above which a frame is voiced
_SPEECH_DB = -30.0  # frames this far below the loudest frame are not speech (end finding)
_MIN_VOICED = 6  # fewer voiced frames than this: no slope


def speech_end(audio: np.ndarray) -> int:
    """Sample where the last speech ends: the end of the last 10 ms frame within 30 dB of the
    loudest one (the turn's trailing silence and noise floor are cut off)."""
    frames = len(audio) // _HOP
    if frames == 0:
        return 0
    rms = np.sqrt(np.mean(audio[: frames * _HOP].reshape(frames, _HOP) ** 2, axis=1)) + 1e-9
    level = 20 * np.log10(rms / rms.max())
    loud = np.flatnonzero(level > _SPEECH_DB)
    return int(loud[-1] + 1) * _HOP


def _pitches(span: np.ndarray) -> np.ndarray:
    """Pitch in Hz of each frame of ``span`` (NaN where not voiced)."""
    starts = np.arange(0, len(span) - _FRAME + 1, _HOP)
    if len(starts) == 0:
        return np.zeros(0)
    frames = span[starts[:, None] + np.arange(_FRAME)]
    frames = frames - frames.mean(axis=1, keepdims=True)
    # Autocorrelation of every frame at once through the FFT (zero-padded: no wrap-around).
    spectrum = np.fft.rfft(frames, n=2 * _FRAME, axis=1)
    correlation = np.fft.irfft(np.abs(spectrum) ** 2, axis=1)[:, :_MAX_LAG]
    lags = _MIN_LAG + np.argmax(correlation[:, _MIN_LAG:_MAX_LAG], axis=1)
    peak = correlation[np.arange(len(frames)), lags]
    voiced = (correlation[:, 0] > 0) & (peak >= _VOICED * correlation[:, 0])
    return np.where(voiced, SAMPLE_RATE / lags, np.nan)


def final_pitch_fall(audio: np.ndarray) -> float | None:
    """log(pitch at the end / pitch before it) over the last ``SPAN_MS`` of speech in ``audio``
    (16 kHz mono float32); negative when the pitch falls. None when too little of it is voiced."""
    end = speech_end(audio)
    span = np.asarray(audio[max(0, end - SPAN_MS * SAMPLE_RATE // 1000) : end], dtype=np.float64)
    pitches = _pitches(span)
    voiced = pitches[~np.isnan(pitches)]
    if len(voiced) < _MIN_VOICED:
        return None
    third = len(voiced) // 3
    return float(np.log(np.median(voiced[-third:]) / np.median(voiced[:third])))
