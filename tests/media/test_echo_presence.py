"""Whether the agent's echo is in the caller's audio (duplex/media/echo_presence.py), on
synthetic envelopes of 10 ms frames: a speakerphone's echo of the agent's speech says "echo"; the
caller's words over a steady tone (the toy preset's voice) with nothing of it coming back say
"none"; a steady tone's own echo, with the caller silent, leaves the state as it was.
"""

from __future__ import annotations

import numpy as np

from duplex.media.echo_presence import EchoPresence
from harness.speech import speech

RATE = 16000
FRAME = RATE // 100


def frames(samples: np.ndarray) -> list[np.ndarray]:
    return [samples[i:i + FRAME] for i in range(0, len(samples) - FRAME + 1, FRAME)]


def tone(seconds: float, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (amplitude * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def run(presence: EchoPresence, far: np.ndarray, near: np.ndarray) -> list[bool]:
    return [presence.update(f, n) for f, n in zip(frames(far), frames(near), strict=False)]


def test_the_callers_words_over_a_steady_tone_say_no_echo() -> None:
    presence = EchoPresence()
    far = tone(6.0)  # the words come once the tone has filled the window (2.6 s of lags)
    words = speech("Wait, stop, I have another question for you.", RATE, 3.0, 0.0)[: len(far)]
    near = np.zeros_like(far)
    near[: len(words)] = words
    states = run(presence, far, near)
    assert states[250] is True  # assumed an echo until shown otherwise
    onset = int(np.flatnonzero(np.abs(near) > 0.02)[0] / FRAME)
    assert states[-1] is False and states.index(False) <= onset + 10, (onset, states.index(False))


def test_a_steady_tones_echo_alone_keeps_the_state() -> None:
    presence = EchoPresence()
    far = tone(3.0)
    near = 0.3 * np.concatenate([np.zeros(int(0.2 * RATE), np.float32), far])[: len(far)]
    assert all(run(presence, far, near))


def test_the_echo_of_speech_says_echo() -> None:
    presence = EchoPresence()
    presence.present = False
    far = speech("The weather today is sunny with a light breeze from the west.", RATE, 0.0, 0.5)
    lag = int(0.2 * RATE)
    near = 0.3 * np.concatenate([np.zeros(lag, np.float32), far])[: len(far)]
    assert run(presence, far, near)[-1] is True
