"""Noise fixtures made at test time, beside harness/speech.py's speech: white noise, and babble
(several people talking at once, as in a café or an open office) made of espeak-ng voices, and
mixing either under speech at a given signal-to-noise ratio. Pure functions of their arguments
(seeded), cached per process like the speech they are made of.
"""

from __future__ import annotations

import functools

import numpy as np

from harness.speech import speech

# Who talks in the background: espeak-ng voices and variants (men and women, several accents),
# each saying something of its own at its own pace.
BABBLERS = (
    ("en-us", 150, "I told him the meeting was moved to Thursday but he never listens to me."),
    ("en-us+f3", 165, "We went to the market on Sunday and bought far too many vegetables."),
    ("en-gb", 140, "The train was late again, so I missed the first half of the lecture."),
    ("en-us+f2", 175, "Have you seen the new place on the corner? The coffee is really good."),
    ("en-gb-scotland", 155, "My sister is moving to Glasgow next month with her two children."),
    ("en-us+m3", 145, "The printer upstairs is broken, so everyone queues for the one here."),
    ("en-029", 160, "They said the concert starts at nine, but the doors open at eight."),
    ("en-gb-x-rp+f4", 150, "I would rather walk home tonight, the weather is lovely for once."),
)


def white_noise(seconds: float, rate: int = 16000, seed: int = 3) -> np.ndarray:
    """Gaussian white noise of unit RMS, float32."""
    return np.random.default_rng(seed).standard_normal(int(seconds * rate)).astype(np.float32)


@functools.cache
def babble(seconds: float, voices: int = 6, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """``voices`` of :data:`BABBLERS` talking at once for ``seconds``, each at the same level and
    looping its sentence from a random point, mixed to unit RMS (float32). Read-only: cached."""
    assert 1 <= voices <= len(BABBLERS), voices
    rng = np.random.default_rng(seed)
    total = int(seconds * rate)
    mix = np.zeros(total, dtype=np.float64)
    for voice, wpm, text in BABBLERS[:voices]:
        words = speech(text, rate, 0.0, 0.3, voice=voice, wpm=wpm)
        words = words / np.sqrt(np.mean(words.astype(np.float64) ** 2))
        looped = np.tile(words, total // len(words) + 2)
        start = int(rng.integers(len(words)))
        mix += looped[start : start + total]
    out = (mix / np.sqrt(np.mean(mix ** 2))).astype(np.float32)
    out.flags.writeable = False
    return out


def speech_level(samples: np.ndarray, floor: float = 0.01) -> float:
    """The RMS of ``samples`` where they are voiced (above ``floor``): the level SNRs refer to."""
    voiced = samples[np.abs(samples) > floor]
    return float(np.sqrt(np.mean(voiced.astype(np.float64) ** 2)))


def at_snr(noise: np.ndarray, level: float, snr_db: float) -> np.ndarray:
    """``noise`` (unit RMS) scaled ``snr_db`` below a speech ``level`` (:func:`speech_level`)."""
    return (noise * level / 10 ** (snr_db / 20)).astype(np.float32)


def under(speech_samples: np.ndarray, noise: np.ndarray, snr_db: float) -> np.ndarray:
    """``noise`` (unit RMS, at least as long) scaled ``snr_db`` below the speech's voiced level."""
    return at_snr(noise[: len(speech_samples)], speech_level(speech_samples), snr_db)
