"""The end-of-turn model (smart-turn v3.2 from the installed pipecat-ai wheel, plus the pitch cue)
and the semantic_vad policy, on real speech made here with espeak-ng; the words cue on transcripts
as Whisper writes them, judged by the offline preset's text judge (SmolLM2-135M).

The sentences are held out: none is in evaluation/turn_utterances.py, where the weights and the
policy were tuned. Each turn is spoken as one SSML utterance, a pause inside it as a ``<break>``,
so the words before a pause keep the pitch of a sentence that goes on.
"""

from __future__ import annotations

import socket
import subprocess
import sys
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
    probability_with_words,
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


def test_the_audio_cues_rank_finished_turns_above_pauses_inside(
    probabilities: dict[str, float],
) -> None:
    finished = [probabilities[t] for t in FINISHED]
    unfinished = [probabilities[before] for before, _ in UNFINISHED]
    # Measured: finished 0.70-0.85, unfinished 0.49-0.70 (on piper's voice the audio says less:
    # the words carry most of the signal, below).
    assert np.mean(finished) - np.mean(unfinished) > 0.08, probabilities
    for before, _ in UNFINISHED:  # the audio alone never ends a turn inside its 800 ms pause
        for silence in range(0, 800 + 1, 32):
            assert decide(probabilities[before], silence, "medium") is Decision.WAIT, before


@pytest.fixture(scope="module")
def judge():  # the text judge the offline preset's asr stage runs
    pytest.importorskip("ctranslate2")
    from pipeline.models.offline.finished_text import FinishedText

    return FinishedText()


# As Whisper writes them, with its full stop. "...book a." cannot end a sentence (the words hold
# the turn); the others may, as far as rules tell, and only the judge of the words says that they
# go on. (Without the full stop they would read as UNKNOWN, the judge would not be weighed, and
# the audio alone cannot reach the bar: such a case could not fail.)
UNFINISHED_HEARD = ["I was hoping you could.", "I would like to book a.",
                    "Could you put me through to.", "My favourite colours are blue.",
                    "Well, I really need this."]


def test_with_the_words_judged_medium_answers_finished_turns_at_once_and_waits_through_pauses(
    probabilities: dict[str, float], judge, tmp_path: Path,
) -> None:
    for text in FINISHED:
        p = probability_with_words(probabilities[text], read_transcript(text), judge.probability(text))
        assert decide(p, MIN_SILENCE_MS, "medium", words=read_transcript(text)) is Decision.END, text
    model = shared_model()
    extra = {"My favourite colours are blue.": "and green.", "Well, I really need this.": "a bigger table."}
    for heard in UNFINISHED_HEARD:
        before = heard.rstrip(".")
        p_audio = probabilities.get(before)
        if p_audio is None:
            spoken = _espeak(f'<speak>{before} <break time="800ms"/> {extra[heard]}</speak>', tmp_path)
            p_audio = model.probability(_asked(_before_pause(spoken)))
        words = read_transcript(heard)
        if words is not Words.INCOMPLETE:  # the judge is weighed: it alone holds these turns
            assert words is Words.COMPLETE, heard
            assert probability_with_words(p_audio, words, 0.5) > patience("medium").threshold, heard
        p = probability_with_words(p_audio, words, judge.probability(heard))
        for silence in range(0, 800 + 1, 32):
            assert decide(p, silence, "medium", words=words) is Decision.WAIT, (heard, p)


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
    p = model.probability(audio)
    assert 0.0 <= p <= 1.0 and p == model.probability(audio)
    assert end_of_turn.shared_model() is end_of_turn.shared_model()


def test_the_features_are_whisper_feature_extractors_without_torch(tmp_path: Path) -> None:
    """smart-turn reads Whisper's log-mel features: ours (numpy) equal transformers' extractor's
    (whose torch path the model was trained with) on speech padded in front as the model pads it,
    and loading the model imports neither transformers nor torch (checked in a fresh process: an
    import there stalled a call's audio)."""
    from transformers import WhisperFeatureExtractor

    from duplex.turns.whisper_features import WhisperLogMel

    speech = _asked(_espeak("<speak>What is the capital of France?</speak>", tmp_path))
    samples = end_of_turn.WINDOW_S * RATE
    clip = np.pad(speech, (samples - len(speech), 0)).astype(np.float32)
    expected = WhisperFeatureExtractor(chunk_length=end_of_turn.WINDOW_S, sampling_rate=RATE)(
        clip, sampling_rate=RATE, return_tensors="np", padding="max_length", max_length=samples,
        truncation=True, do_normalize=True).input_features
    ours = WhisperLogMel()(clip)
    assert ours.shape == expected.shape == (1, 80, 800)
    assert np.abs(ours - expected).max() < 1e-4
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys; from duplex.turns.end_of_turn import EndOfTurnModel; "
         "EndOfTurnModel(); print(sorted({'torch', 'transformers'} & set(sys.modules)))"],
        capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout


@pytest.mark.parametrize(("transcript", "words"), [
    ("What is the capital of France?", Words.COMPLETE),
    ("Thank you.", Words.COMPLETE),  # "you" may end a sentence
    ("I would like to order a large pizza and.", Words.INCOMPLETE),  # Whisper's full stop
    ("Could you book me a.", Words.INCOMPLETE),
    ("How many legs does a spider have?", Words.COMPLETE),  # auxiliaries, prepositions and
    ("Where are you from?", Words.COMPLETE),  # pronouns may end one: the text judge reads them
    ("I think that...", Words.INCOMPLETE),
    ("I need eggs, milk,", Words.INCOMPLETE),
    ("My number is 555.", Words.UNKNOWN),  # numbers are read in groups
    ("The order number is a B.", Words.UNKNOWN),
    ("Okay", Words.UNKNOWN),
    ("", Words.UNKNOWN),
])
def test_the_last_words_say_whether_a_sentence_can_end_there(transcript: str, words: Words) -> None:
    assert read_transcript(transcript) is words


def test_the_judged_words_join_only_when_they_read_as_finished_and_unfinished_ones_hold() -> None:
    rule = patience(Eagerness.MEDIUM)
    p_audio = 0.6  # below the bar
    sure = probability_with_words(p_audio, Words.COMPLETE, 0.5)
    assert sure is not None and sure > rule.threshold
    assert decide(sure, MIN_SILENCE_MS, rule=rule, words=Words.COMPLETE) is Decision.END
    assert probability_with_words(p_audio, Words.COMPLETE, 0.0001) < p_audio  # judged going on
    # Numbers and codes say nothing, whatever the judge says; nothing is weighed before the audio.
    assert probability_with_words(p_audio, Words.UNKNOWN, 0.5) == p_audio
    assert probability_with_words(p_audio, None, None) == p_audio
    assert probability_with_words(None, Words.COMPLETE, 0.5) is None
    # Words that cannot end a sentence: even a sure model waits, and the maximum still ends it.
    late = rule.max_wait_ms - 32
    assert decide(0.999, late, rule=rule) is Decision.END
    assert decide(0.999, late, rule=rule, words=Words.INCOMPLETE) is Decision.WAIT
    assert decide(0.0, rule.max_wait_ms, rule=rule, words=Words.INCOMPLETE) is Decision.END
