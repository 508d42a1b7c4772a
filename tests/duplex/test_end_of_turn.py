"""The end-of-turn model (smart-turn v3.2 from the installed pipecat-ai wheel, plus the pitch cue)
and the semantic_vad policy, on real speech made here with espeak-ng; the words cue on transcripts
as Whisper writes them.

The sentences are held out: none is in evaluation/turn_utterances.py, where the weights and the
policy were tuned. Each turn is spoken as one SSML utterance, a pause inside it as a ``<break>``,
so the words before a pause keep the pitch of a sentence that goes on.
"""

from __future__ import annotations

import socket
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest

from duplex.turns import end_of_turn
from duplex.turns.end_of_turn import EndOfTurnModel, model_path, shared_model
from duplex.turns.semantic_policy import (
    MAX_WAIT_MS,
    MIN_SILENCE_MS,
    Decision,
    Eagerness,
    decide,
    patience,
)
from duplex.turns.transcript_cue import Words, read_transcript

RATE = 16000
LOUD = 0.004  # |sample| above this is sound (espeak pads its output with digital silence)

FINISHED = ["Please send me the invoice.", "We are out of coffee.", "Nothing else, thank you."]
UNFINISHED = [  # (words before the pause, words after it)
    ("I was hoping you could", "help me tomorrow."),
    ("I would like to book a", "room for two nights."),
    ("Could you put me through to", "the billing department?"),
]


def _espeak(ssml: str, folder: Path) -> np.ndarray:
    raw, out = folder / "raw.wav", folder / "out.wav"
    subprocess.run(["espeak-ng", "-m", "-v", "en-us", "-s", "150", "-w", str(raw), ssml],
                   check=True)
    # No dither: the model's answer must not depend on sox's random dither.
    subprocess.run(["sox", "--no-dither", str(raw), "-r", str(RATE), "-c", "1", "-b", "16",
                    "-e", "signed-integer", str(out)], check=True)
    with wave.open(str(out), "rb") as w:
        audio = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768
    loud = np.flatnonzero(np.abs(audio) > LOUD)
    return audio[loud[0] : loud[-1] + 1]


def _asked(speech: np.ndarray) -> np.ndarray:
    """The turn's audio as the detector hands it to the model: a little silence before the words,
    and the pause so far after them (the VAD's ~60 ms lag plus ``MIN_SILENCE_MS``)."""
    noise = np.random.default_rng(0).normal(0, 5e-4, RATE).astype(np.float32)
    after = (MIN_SILENCE_MS + 64) * RATE // 1000
    return np.concatenate([noise[: RATE // 2], speech, noise[:after]])


def _before_pause(speech: np.ndarray) -> np.ndarray:
    """The words before the longest silence (the break) of ``speech``."""
    loud = np.flatnonzero(np.abs(speech) > LOUD)
    gap = int(np.argmax(np.diff(loud)))
    assert loud[gap + 1] - loud[gap] > 0.5 * RATE, "the break is missing"
    return speech[: loud[gap] + 1]


@pytest.fixture(scope="module")
def probabilities(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    folder = tmp_path_factory.mktemp("end-of-turn")
    model = shared_model()
    out = {}
    for text in FINISHED:
        out[text] = model.probability(_asked(_espeak(f"<speak>{text}</speak>", folder)))
    for before, after in UNFINISHED:
        spoken = _espeak(f'<speak>{before} <break time="800ms"/> {after}</speak>', folder)
        out[before] = model.probability(_asked(_before_pause(spoken)))
    return out


def test_finished_turns_score_high_and_pauses_inside_low(probabilities: dict[str, float]) -> None:
    finished = [probabilities[t] for t in FINISHED]
    unfinished = [probabilities[before] for before, _ in UNFINISHED]
    # Measured: finished 0.85-0.94, unfinished 0.22-0.70.
    assert min(finished) >= 0.78, probabilities
    assert max(unfinished) < 0.78, probabilities
    assert np.mean(finished) - np.mean(unfinished) > 0.25, probabilities


def test_medium_answers_finished_turns_at_once_and_waits_through_pauses(
    probabilities: dict[str, float],
) -> None:
    # Not every finished turn is answered at the first ask (the cues are not that sure), but
    # none of the unfinished ones may end anywhere inside its 800 ms pause.
    at_once = [decide(probabilities[t], MIN_SILENCE_MS, "medium") for t in FINISHED]
    assert Decision.END in at_once, probabilities
    for before, _ in UNFINISHED:
        for silence in range(0, 800 + 1, 32):
            assert decide(probabilities[before], silence, "medium") is Decision.WAIT, before


@pytest.mark.parametrize("eagerness", ["low", "medium", "high"])
def test_max_wait_ends_any_turn(eagerness: str) -> None:
    limit = MAX_WAIT_MS[Eagerness(eagerness)]
    assert limit == {"low": 8000, "medium": 4000, "high": 2000}[eagerness]
    for p in (None, 0.0):
        assert decide(p, limit - 1, eagerness) is Decision.WAIT
        assert decide(p, limit, eagerness) is Decision.END
    # The bar only falls as the silence grows.
    rule = patience(eagerness)
    bars = [rule.required(s) for s in [*range(MIN_SILENCE_MS, limit, 32), limit]]
    assert bars == sorted(bars, reverse=True) and bars[-1] == 0.0


def test_nothing_ends_before_the_minimum_silence_and_auto_is_medium() -> None:
    for eagerness in Eagerness:
        assert decide(1.0, MIN_SILENCE_MS - 1, eagerness) is Decision.WAIT
        assert decide(1.0, MIN_SILENCE_MS, eagerness) is Decision.END
    assert patience("auto") == patience("medium")


def test_model_loads_from_the_installed_wheel_without_network(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the end-of-turn model tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    path = model_path()
    assert path.is_file() and {"site-packages", "dist-packages"} & set(path.parts), path
    model = EndOfTurnModel(path)
    audio = _asked(np.zeros(RATE, dtype=np.float32))
    p = model.probability(audio, transcript="a transcript changes nothing yet")
    assert 0.0 <= p <= 1.0 and p == model.probability(audio)
    assert end_of_turn.shared_model() is end_of_turn.shared_model()


@pytest.mark.parametrize(("transcript", "words"), [
    ("What is the capital of France?", Words.COMPLETE),
    ("Thank you.", Words.COMPLETE),  # "you" may end a sentence
    ("I would like to order a large pizza with.", Words.INCOMPLETE),  # Whisper's full stop
    ("I think that...", Words.INCOMPLETE),
    ("I need eggs, milk,", Words.INCOMPLETE),
    ("My number is 555.", Words.UNKNOWN),  # numbers are read in groups
    ("The order number is a B.", Words.UNKNOWN),
    ("Okay", Words.UNKNOWN),
    ("", Words.UNKNOWN),
])
def test_the_last_words_say_whether_a_sentence_can_end_there(transcript: str, words: Words) -> None:
    assert read_transcript(transcript) is words


def test_words_lower_the_bar_or_hold_the_turn_until_the_maximum_wait() -> None:
    rule = patience(Eagerness.MEDIUM)
    p = (rule.words_threshold + rule.threshold) / 2  # between the two bars
    assert decide(p, MIN_SILENCE_MS, rule=rule) is Decision.WAIT
    assert decide(p, MIN_SILENCE_MS, rule=rule, words=Words.COMPLETE) is Decision.END
    assert decide(p, MIN_SILENCE_MS, rule=rule, words=Words.UNKNOWN) is Decision.WAIT
    # Words that cannot end a sentence: even a sure model waits, and the maximum still ends it.
    late = rule.max_wait_ms - 32
    assert decide(0.999, late, rule=rule) is Decision.END
    assert decide(0.999, late, rule=rule, words=Words.INCOMPLETE) is Decision.WAIT
    assert decide(0.0, rule.max_wait_ms, rule=rule, words=Words.INCOMPLETE) is Decision.END
