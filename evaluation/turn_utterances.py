"""The end-of-turn evaluation set: spoken turns made at run time with espeak-ng and sox.

Every turn ends complete; some have pauses in the middle where the speaker has not finished (an
order cut off mid-phrase, a phone number read in two groups, a list read in pieces). A detector
must answer soon after the last piece and never inside those pauses. Each script is spoken by
two espeak-ng voice/rate combinations and once in piper's natural voice (where the ``offline``
extra is installed), so 48 scripts give 144 turns, and the kinds are mixed so that no single
style dominates the tuning: espeak-ng's rule-made intonation and piper's learned one differ, and
Whisper hears piper far better.

Synthesis (espeak-ng): espeak-ng speaks each script as one SSML utterance with a ``<break>`` per pause (see
:func:`_speak` for why), sox converts it to 16 kHz mono 16-bit, and it is trimmed to where its
sound starts and stops, so the end of speech is known to within a few ms. Silence before and after
is added in numpy, then a faint seeded noise floor (-66 dBFS RMS) over everything: real
microphones are never digitally silent. WAVs are cached in a temporary folder for the life of the
process.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
LEAD_S = 0.5  # silence before the first word
NOISE_RMS = 0.0005  # -66 dBFS
_TRIM_LEVEL = 0.004  # |sample| above this counts as sound when trimming espeak's own silence
_CACHE = Path(tempfile.mkdtemp(prefix="duplex-turns-"))

# (espeak-ng voice, words per minute): men, women, US and British, slow to fast.
VOICES: tuple[tuple[str, int], ...] = (
    ("en-us+m3", 140),
    ("en-us+f2", 165),
    ("en-gb", 150),
    ("en-us+m1", 180),
    ("en-gb+f3", 135),
    ("en-us+f4", 155),
)
# piper's length scale (above 1: slower), alternating over the scripts.
NATURAL_RATES = (0.9, 1.15)


@dataclass(frozen=True)
class Script:
    """What is said: pieces spoken with ``pauses_ms`` of silence between them (one fewer)."""

    kind: str
    pieces: tuple[str, ...]
    pauses_ms: tuple[int, ...] = ()


@dataclass(frozen=True)
class Utterance:
    """One spoken turn: audio, where each piece's speech ends, and where the turn ends."""

    name: str
    kind: str
    text: str
    voice: str
    audio: np.ndarray  # float32 16 kHz mono, LEAD_S of silence before, ``tail_s`` after
    piece_ends_ms: tuple[int, ...]  # end of speech of each piece; the last is the turn's end

    @property
    def speech_end_ms(self) -> int:
        return self.piece_ends_ms[-1]

    @property
    def pauses(self) -> int:
        """Pauses inside the turn, where ending it would cut the speaker off."""
        return len(self.piece_ends_ms) - 1


def _s(kind: str, *pieces: str, pauses: tuple[int, ...] = ()) -> Script:
    return Script(kind, pieces, pauses)


# Pauses inside unfinished turns run 400-1000 ms; the cases are 900 ms (an order) and
# 700 ms (a phone number).
SCRIPTS: tuple[Script, ...] = (
    # complete questions
    _s("question", "What time does the store open tomorrow?"),
    _s("question", "Can you help me reset my password?"),
    _s("question", "How far is the airport from here?"),
    _s("question", "Is it going to rain this weekend?"),
    _s("question", "Where did I leave my keys?"),
    _s("question", "Could you book a table for two at eight?"),
    _s("question", "What is the capital of Australia?"),
    _s("question", "Do you know any good Italian restaurants nearby?"),
    _s("question", "Why is the sky blue?"),
    _s("question", "How much does the monthly plan cost?"),
    # complete statements
    _s("statement", "I need to change my delivery address."),
    _s("statement", "The package arrived damaged this morning."),
    _s("statement", "Please cancel my subscription."),
    _s("statement", "My flight was delayed by three hours."),
    _s("statement", "I would like a refund for the last order."),
    _s("statement", "Turn off the lights in the kitchen."),
    _s("statement", "That was the best movie I have seen all year."),
    _s("statement", "Send the report to my manager."),
    _s("statement", "I am calling about my bill."),
    _s("statement", "Set an alarm for six thirty."),
    # complete short answers
    _s("short", "Yes."),
    _s("short", "No thanks."),
    _s("short", "Sure."),
    _s("short", "Okay."),
    _s("short", "That's right."),
    _s("short", "No."),
    _s("short", "Thank you."),
    _s("short", "Sounds good."),
    # unfinished sentences with a pause in the middle
    _s("unfinished", "I would like to order a large pizza with", "mushrooms and olives.",
       pauses=(900,)),
    _s("unfinished", "Can you tell me about the", "opening hours on Sunday?", pauses=(800,)),
    _s("unfinished", "I think that", "we should leave early.", pauses=(700,)),
    _s("unfinished", "My appointment is on", "Thursday afternoon.", pauses=(1000,)),
    _s("unfinished", "I want to fly from Boston to", "Chicago next Friday.", pauses=(600,)),
    _s("unfinished", "The problem is that the", "screen keeps flickering.", pauses=(900,)),
    _s("unfinished", "Could you remind me to", "call my mother tonight?", pauses=(500,)),
    _s("unfinished", "I am looking for a hotel near the", "train station.", pauses=(800,)),
    _s("unfinished", "What I really need is", "a bigger table.", pauses=(1000,)),
    _s("unfinished", "So I went to the bank and", "they told me to come back later.",
       pauses=(700,)),
    # numbers and lists read in groups
    _s("number", "My number is 555", "0192.", pauses=(700,)),
    _s("number", "The code is 4 7 1", "9 3 2.", pauses=(600,)),
    _s("number", "My card ends in 42", "17.", pauses=(800,)),
    _s("number", "Call me at 617", "555", "2368.", pauses=(700, 500)),
    _s("number", "My zip code is 02", "139.", pauses=(900,)),
    _s("number", "The order number is A B", "7 7 5.", pauses=(1000,)),
    _s("list", "I need eggs, milk,", "bread and butter.", pauses=(800,)),
    _s("list", "Add apples", "bananas", "and some grapes.", pauses=(600, 700)),
    _s("list", "We visited Paris, Rome", "and then Vienna.", pauses=(900,)),
    _s("list", "The colors are red, green", "and blue.", pauses=(400,)),
)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True)


def _silent_runs(audio: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) sample ranges where ``audio`` stays at or below the trim level."""
    loud = np.flatnonzero(np.abs(audio) > _TRIM_LEVEL)
    gaps = np.flatnonzero(np.diff(loud) > 1)
    return [(int(loud[g]) + 1, int(loud[g + 1])) for g in gaps]


@functools.cache
def _speak(script: Script, voice: str, rate: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """``script`` spoken in one go by espeak-ng at 16 kHz, trimmed to its sound, and the sample
    where each piece ends.

    One SSML utterance with ``<break>``s rather than pieces spoken apart: espeak gives a piece
    spoken alone the falling pitch of a finished sentence, while a break inside one sentence keeps
    the pitch of a sentence that goes on, as a speaker who pauses mid-phrase does. The pieces'
    ends are found again as the longest silences of the result (the breaks, ~±20 ms).
    """
    key = hashlib.sha1(f"{script}|{voice}|{rate}".encode()).hexdigest()[:16]
    raw, out = _CACHE / f"{key}.raw.wav", _CACHE / f"{key}.wav"
    if not out.exists():
        breaks = [f' <break time="{ms}ms"/> ' for ms in script.pauses_ms] + [""]
        ssml = "<speak>" + "".join(p + b for p, b in zip(script.pieces, breaks)) + "</speak>"
        _run(["espeak-ng", "-m", "-v", voice, "-s", str(rate), "-w", str(raw), ssml])
        # No dither: sox's random dither would make each run's audio, and so the model's
        # answers, differ (smart-turn moves by up to 0.3 on such -90 dB differences).
        _run(["sox", "--no-dither", str(raw), "-r", str(SAMPLE_RATE), "-c", "1", "-b", "16",
              "-e", "signed-integer", str(out)])
    with wave.open(str(out), "rb") as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    audio = samples.astype(np.float32) / 32768.0
    loud = np.flatnonzero(np.abs(audio) > _TRIM_LEVEL)
    audio = audio[loud[0] : loud[-1] + 1]
    runs = sorted(_silent_runs(audio), key=lambda run: run[1] - run[0])[::-1]
    breaks_at = sorted(start for start, _ in runs[: len(script.pauses_ms)])
    return audio, (*breaks_at, len(audio))


def _render(script: Script, speech: np.ndarray, ends: tuple[int, ...], voice: str, tail_s: float,
            seed: int) -> Utterance:
    """``script`` as spoken (``speech``, its pieces ending at ``ends``), with ``tail_s`` of
    silence after the turn."""
    lead = int(LEAD_S * SAMPLE_RATE)
    audio = np.concatenate([
        np.zeros(lead, dtype=np.float32), speech, np.zeros(int(tail_s * SAMPLE_RATE), np.float32)
    ])
    audio += np.random.default_rng(seed).normal(0.0, NOISE_RMS, len(audio)).astype(np.float32)
    return Utterance(
        name=f"{script.kind}:{script.pieces[0][:24]}|{voice}",
        kind=script.kind,
        text=" / ".join(script.pieces),
        voice=voice,
        audio=audio,
        piece_ends_ms=tuple((lead + end) * 1000 // SAMPLE_RATE for end in ends),
    )


@functools.cache
def _speak_natural(script: Script, length_scale: float) -> tuple[np.ndarray, tuple[int, ...]]:
    """``script`` in piper's natural voice at 16 kHz, piece by piece with its pauses between, and
    the sample where each piece ends. Each piece is spoken apart (piper reads the text it is
    given, so a piece without a full stop is read as a phrase that goes on) and trimmed to its
    sound, so the pauses are exactly the script's."""
    from harness.speech import natural_speech

    pieces, ends, at = [], [], 0
    for index, text in enumerate(script.pieces):
        audio = natural_speech(text, SAMPLE_RATE, 0.0, 0.0, length_scale)
        loud = np.flatnonzero(np.abs(audio) > _TRIM_LEVEL)
        audio = audio[loud[0] : loud[-1] + 1]
        pause = script.pauses_ms[index] * SAMPLE_RATE // 1000 if index < len(script.pauses_ms) else 0
        pieces += [audio, np.zeros(pause, np.float32)]
        at += len(audio)
        ends.append(at)
        at += pause
    return np.concatenate(pieces), tuple(ends)


def utterances(tail_s: float) -> list[Utterance]:
    """Every script in two espeak-ng voices (rotating through :data:`VOICES`) and, where piper is
    installed (the ``offline`` extra), in its natural voice at one of :data:`NATURAL_RATES`: the
    evaluation set."""
    out = []
    for i, script in enumerate(SCRIPTS):
        for j in range(2):
            voice, rate = VOICES[(2 * i + j) % len(VOICES)]
            out.append(_render(script, *_speak(script, voice, rate), f"{voice} -s {rate}", tail_s,
                               seed=2 * i + j))
    try:
        import piper  # noqa: F401 - only whether it is there
    except ImportError:
        print("piper is not installed: the set is espeak-ng speech only")
        return out
    for i, script in enumerate(SCRIPTS):
        scale = NATURAL_RATES[i % len(NATURAL_RATES)]
        out.append(_render(script, *_speak_natural(script, scale), f"piper joe x{scale}", tail_s,
                           seed=1000 + i))
    return out
