"""Whisper's log-mel features in numpy: what smart-turn v3.2 (:mod:`duplex.turns.end_of_turn`)
reads, as transformers' ``WhisperFeatureExtractor`` computes them.

Why not that class: importing it imports transformers and torch (~2.5 s where nothing imported
them before), which the server process needs for nothing else. The end-of-turn model loads at
the first pause of the first semantic_vad session, and those imports there, holding the GIL,
stalled that call's audio (a LiveKit client's next question went unheard). The computation is the
extractor's own numpy path: the waveform normalised to zero mean and unit variance, a centred STFT
(400-sample periodic Hann window, hop 160, reflect padding), the power spectrum through 80 Slaney
mel filters from 0 to 8 kHz, log10 floored at 1e-10, the last frame dropped, the range clamped to
8 below the maximum and scaled as ``(x + 4) / 4``. ``tests/duplex/test_end_of_turn.py`` checks it against the
extractor.

Stateless after construction (the window and the filter bank); shared by the process's one model.
"""

from __future__ import annotations

import math

import numpy as np

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
N_MELS = 80
MEL_FLOOR = 1e-10


def _hertz_to_mel(hertz: np.ndarray) -> np.ndarray:
    """The Slaney mel scale: linear below 1 kHz, logarithmic above."""
    log_step = 27.0 / math.log(6.4)
    mels = 3.0 * hertz / 200.0
    above = hertz >= 1000.0
    return np.where(above, 15.0 + np.log(np.maximum(hertz, 1e-10) / 1000.0) * log_step, mels)


def _mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    log_step = math.log(6.4) / 27.0
    hertz = 200.0 * mels / 3.0
    return np.where(mels >= 15.0, 1000.0 * np.exp(log_step * (mels - 15.0)), hertz)


def mel_filters(n_mels: int = N_MELS, n_fft: int = N_FFT, rate: int = SAMPLE_RATE) -> np.ndarray:
    """Triangular filters evenly spaced on the Slaney mel scale from 0 to ``rate / 2``, each
    scaled to unit area (Slaney's normalisation): ``(n_fft // 2 + 1, n_mels)``."""
    fft_freqs = np.linspace(0, rate // 2, n_fft // 2 + 1)
    edges = _mel_to_hertz(np.linspace(_hertz_to_mel(np.array(0.0)), _hertz_to_mel(np.array(rate / 2)),
                                      n_mels + 2))
    widths = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    return filters * (2.0 / (edges[2 : n_mels + 2] - edges[:n_mels]))[None, :]


class WhisperLogMel:
    """Log-mel features of a clip, shaped ``(1, N_MELS, frames)`` float32 (see module doc)."""

    def __init__(self) -> None:
        self._window = np.hanning(N_FFT + 1)[:-1]  # periodic
        self._filters = mel_filters()

    def __call__(self, clip: np.ndarray) -> np.ndarray:
        samples = np.asarray(clip, dtype=np.float32)
        samples = (samples - samples.mean()) / np.sqrt(samples.var() + 1e-7)
        padded = np.pad(samples.astype(np.float64), N_FFT // 2, mode="reflect")
        count = 1 + (len(padded) - N_FFT) // HOP
        frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP][:count]
        power = np.abs(np.fft.rfft(frames * self._window, n=N_FFT)) ** 2
        log_mel = np.log10(np.maximum(MEL_FLOOR, power @ self._filters)).T[:, :-1]
        log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
        return ((log_mel + 4.0) / 4.0)[None].astype(np.float32)
