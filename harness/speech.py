"""Speech fixtures made at test time (a user's clone ships no audio): espeak-ng with sox, and
piper's natural voice for checks of what a recogniser hears.

Results are cached per process (espeak-ng files in a temporary directory); each call returns the
path of a 16-bit PCM mono WAV, or the samples as float32 at the requested rate.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
import tempfile
import wave
from pathlib import Path
from typing import Any

import numpy as np

_DIR = Path(tempfile.mkdtemp(prefix="duplex-speech-"))


@functools.cache
def speech_wav(
    text: str, rate: int = 48000, pad_before_s: float = 0.5, pad_after_s: float = 1.0,
    voice: str = "en-us", wpm: int = 150,
) -> Path:
    """espeak-ng speech of ``text`` (``voice`` at ``wpm`` words a minute) as a 16-bit mono WAV
    at ``rate``, padded with silence."""
    key = hashlib.sha1(f"{text}|{rate}|{pad_before_s}|{pad_after_s}|{voice}|{wpm}".encode()).hexdigest()[:12]
    raw = _DIR / f"{key}.raw.wav"
    out = _DIR / f"{key}.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(wpm), "-w", str(raw), text], check=True)
    subprocess.run(
        ["sox", str(raw), "-r", str(rate), "-c", "1", "-b", "16", "-e", "signed-integer",
         str(out), "pad", str(pad_before_s), str(pad_after_s)],
        check=True,
    )
    return out


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """Samples of a 16-bit mono WAV as float32 in [-1, 1], and its rate."""
    with wave.open(str(path), "rb") as w:
        assert w.getsampwidth() == 2 and w.getnchannels() == 1, path
        frames = w.readframes(w.getnframes())
        return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0, w.getframerate()


def speech(text: str, rate: int = 16000, pad_before_s: float = 0.5, pad_after_s: float = 1.0,
           voice: str = "en-us", wpm: int = 150) -> np.ndarray:
    """espeak-ng speech of ``text`` as float32 samples at ``rate`` (see :func:`speech_wav`)."""
    samples, got = read_wav(speech_wav(text, rate, pad_before_s, pad_after_s, voice, wpm))
    assert got == rate
    return samples


@functools.cache
def _piper_voice() -> Any:
    from pipeline.models.offline.sources import voice_model
    from pipeline.models.offline.tts import load_voice

    return load_voice(voice_model("packaged"), threads=1)


@functools.cache
def natural_speech(text: str, rate: int = 16000, pad_before_s: float = 0.5,
                   pad_after_s: float = 1.0, length_scale: float = 1.0) -> np.ndarray:
    """piper speech of ``text`` (the ``joe`` voice, 22.05 kHz) as float32 samples at ``rate``;
    ``length_scale`` above 1 speaks slower.

    A natural voice, for checks of what a recogniser makes of a question: Whisper tiny.en hears
    espeak-ng's "of France" as "and friends", a person's voice as it was said.
    """
    from piper import SynthesisConfig

    from duplex.media.resample import Resampler

    voice = _piper_voice()
    chunks = voice.synthesize(text, syn_config=SynthesisConfig(length_scale=length_scale))
    audio = np.concatenate([chunk.audio_float_array for chunk in chunks])
    source = voice.config.sample_rate
    resampler = Resampler(source, rate)
    samples = np.concatenate([resampler.push(audio.astype(np.float32)), resampler.flush()])
    pad = (np.zeros(int(rate * pad_before_s), np.float32), np.zeros(int(rate * pad_after_s), np.float32))
    return np.concatenate([pad[0], samples, pad[1]])


@functools.cache
def speech_with_pauses(pieces: tuple[str, ...], pauses_ms: tuple[int, ...], rate: int = 16000,
                       pad_before_s: float = 0.5, pad_after_s: float = 1.0,
                       voice: str = "en-us", wpm: int = 150) -> np.ndarray:
    """One espeak-ng utterance of ``pieces`` with a pause of ``pauses_ms[i]`` after piece ``i``.

    Spoken as one SSML sentence with ``<break>``s, not as pieces spoken apart: espeak gives a piece
    spoken alone the falling pitch of a finished sentence, a break inside one keeps it level.
    """
    breaks = [f' <break time="{ms}ms"/> ' for ms in pauses_ms] + [""]
    ssml = "<speak>" + "".join(p + b for p, b in zip(pieces, breaks, strict=True)) + "</speak>"
    key = hashlib.sha1(f"{ssml}|{rate}|{pad_before_s}|{pad_after_s}|{voice}|{wpm}".encode()).hexdigest()[:12]
    raw, out = _DIR / f"{key}.raw.wav", _DIR / f"{key}.wav"
    subprocess.run(["espeak-ng", "-m", "-v", voice, "-s", str(wpm), "-w", str(raw), ssml], check=True)
    subprocess.run(["sox", str(raw), "-r", str(rate), "-c", "1", "-b", "16", "-e", "signed-integer",
                    str(out), "pad", str(pad_before_s), str(pad_after_s)], check=True)
    samples, got = read_wav(out)
    assert got == rate
    return samples
