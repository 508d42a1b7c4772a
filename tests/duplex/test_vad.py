"""TurnDetector on real espeak-ng speech and the real silero-vad ONNX model."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from duplex.turns.config import TurnDetection
from duplex.turns.server_vad import SpeechStarted, SpeechStopped, TurnDetector
from duplex.turns.vad import WINDOW
from harness.speech import speech

RATE = 16000


def voiced(text: str) -> np.ndarray:
    """espeak-ng speech with its own leading and trailing silence cut off."""
    samples = speech(text, RATE, 0.0, 0.0)
    loud = np.nonzero(np.abs(samples) > 1e-3)[0]
    return samples[loud[0] : loud[-1] + 1]


@dataclass
class Utterance:
    audio: np.ndarray
    onset_ms: float  # where the first word begins
    offset_ms: float  # where the last word ends


def utterance(*parts: str, pause_s: float = 0.34, lead_s: float = 0.7, tail_s: float = 1.2):
    """Speech parts separated by exact pauses of digital silence, with known onset and offset."""
    pieces = [np.zeros(int(lead_s * RATE), np.float32)]
    for i, text in enumerate(parts):
        if i:
            pieces.append(np.zeros(int(pause_s * RATE), np.float32))
        pieces.append(voiced(text))
    speech_end = sum(map(len, pieces))
    pieces.append(np.zeros(int(tail_s * RATE), np.float32))
    return Utterance(np.concatenate(pieces), lead_s * 1000, speech_end * 1000 / RATE)


def run(detector: TurnDetector, samples: np.ndarray, chunk: int = 320) -> list:
    """Feed like the WebRTC inbound path does: 20 ms at a time."""
    events = []
    for start in range(0, len(samples), chunk):
        events += detector.process(samples[start : start + chunk])
    return events


@pytest.fixture(scope="module")
def sentence() -> Utterance:
    return utterance("Could you tell me what the weather will be like tomorrow?")


@pytest.fixture
def detector() -> TurnDetector:
    return TurnDetector()


def test_onset_and_end_of_turn_near_the_truth(detector: TurnDetector, sentence: Utterance) -> None:
    events = run(detector, sentence.audio)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]
    started, stopped = events
    # Onset within a few 32 ms windows of where the voice starts, never long before it.
    assert sentence.onset_ms - 32 <= started.start_ms <= sentence.onset_ms + 100
    assert started.padded_start_ms == started.start_ms - 300
    assert abs(stopped.speech_end_ms - sentence.offset_ms) <= 150
    # The turn ends once silence_duration_ms of silence followed the speech, on a window edge.
    assert 500 <= stopped.end_ms - stopped.speech_end_ms < 500 + 32
    assert stopped.start_ms == started.start_ms
    assert stopped.padded_start_ms == started.padded_start_ms
    assert not stopped.forced


def test_turn_audio_is_the_input_from_prefix_padding_to_turn_end(
    detector: TurnDetector, sentence: Utterance
) -> None:
    _, stopped = run(detector, sentence.audio)
    begin, end = stopped.padded_start_ms * RATE // 1000, stopped.end_ms * RATE // 1000
    assert np.array_equal(stopped.audio, sentence.audio[begin:end])


def test_events_do_not_depend_on_chunking(sentence: Utterance) -> None:
    def summary(events: list) -> list:
        return [(type(e).__name__, e.start_ms, e.padded_start_ms,
                 getattr(e, "end_ms", None), getattr(e, "audio", np.zeros(0)).tobytes())
                for e in events]

    reference = summary(TurnDetector().process(sentence.audio))
    assert summary(run(TurnDetector(), sentence.audio, 320)) == reference
    irregular = TurnDetector()
    cuts = np.cumsum(np.random.default_rng(0).integers(1, 3000, size=200))
    events = [e for piece in np.split(sentence.audio, cuts[cuts < len(sentence.audio)])
              for e in irregular.process(piece)]
    assert summary(events) == reference


def test_a_340_ms_pause_mid_sentence_does_not_end_the_turn(detector: TurnDetector) -> None:
    spoken = utterance("I would like to order", "a large pizza with extra cheese", pause_s=0.34)
    events = run(detector, spoken.audio)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]
    assert abs(events[1].speech_end_ms - spoken.offset_ms) <= 150


def test_a_pause_longer_than_silence_duration_splits_turns(detector: TurnDetector) -> None:
    spoken = utterance("I would like to order", "a large pizza with extra cheese", pause_s=0.9)
    events = run(detector, spoken.audio)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped] * 2
    first, second = events[1], events[3]
    # The second turn's prefix never reaches back into the first turn.
    assert events[2].padded_start_ms >= first.end_ms
    assert second.padded_start_ms == events[2].padded_start_ms


def test_silence_duration_is_configurable(detector: TurnDetector) -> None:
    spoken = utterance("I would like to order", "a large pizza with extra cheese", pause_s=0.34)
    detector.config = TurnDetection(silence_duration_ms=200)
    assert [type(e) for e in run(detector, spoken.audio)] == [SpeechStarted, SpeechStopped] * 2


def test_threshold_override_moves_the_onset_to_the_first_window_above_it(
    sentence: Utterance,
) -> None:
    probing = TurnDetector()
    probabilities = []
    for start in range(0, len(sentence.audio) - WINDOW + 1, WINDOW):
        probing.process(sentence.audio[start : start + WINDOW])
        probabilities.append(probing.probability)
    probabilities = np.array(probabilities)
    onsets = set()
    for threshold in (0.5, 0.7, 0.9, 0.99):
        expected = int(np.argmax(probabilities >= threshold)) * WINDOW * 1000 // RATE
        detector = TurnDetector()
        detector.threshold_override = threshold
        assert detector.threshold == threshold
        assert run(detector, sentence.audio)[0].start_ms == expected
        onsets.add(expected)
    assert len(onsets) > 1  # the speech rises through these thresholds over several windows
    unreachable = TurnDetector()
    unreachable.threshold_override = float(probabilities.max()) + 1e-6
    assert run(unreachable, sentence.audio) == []
    unreachable.threshold_override = None
    assert unreachable.threshold == 0.5


def test_silence_and_noise_floor_start_no_turn(detector: TurnDetector) -> None:
    noise = np.random.default_rng(1).normal(0, 0.003, RATE * 3).astype(np.float32)
    assert run(detector, np.zeros(RATE * 2, np.float32)) == []
    assert run(detector, noise) == []
    assert not detector.in_speech and detector.position_ms == 5000 - 5000 % 32


def test_speech_and_silence_counters_follow_the_turn(
    detector: TurnDetector, sentence: Utterance
) -> None:
    events, counters = [], []
    for start in range(0, len(sentence.audio), 320):
        events += detector.process(sentence.audio[start : start + 320])
        if detector.in_speech:
            onset = events[-1].start_ms
            assert detector.speech_ms + detector.silence_ms == detector.position_ms - onset
            counters.append((detector.speech_ms, detector.silence_ms))
    started, stopped = events
    assert counters[-1][0] == stopped.speech_end_ms - started.start_ms
    assert max(silence for _, silence in counters) < 500
    assert not detector.in_speech and detector.speech_ms == detector.silence_ms == 0


def test_discard_turn_drops_it_and_the_next_turn_starts_afresh(
    detector: TurnDetector, sentence: Utterance
) -> None:
    half = int((sentence.onset_ms + 400) * RATE / 1000)
    events = detector.process(sentence.audio[:half])
    assert [type(e) for e in events] == [SpeechStarted] and detector.in_speech
    detector.discard_turn()
    discarded_at = detector.position_ms
    assert not detector.in_speech
    later = detector.process(sentence.audio[half:])
    # The rest of the sentence is a new turn whose audio starts after the discarded part.
    assert [type(e) for e in later] == [SpeechStarted, SpeechStopped]
    assert later[0].padded_start_ms >= discarded_at
    assert len(later[1].audio) == (later[1].end_ms - later[1].padded_start_ms) * RATE // 1000


def test_max_turn_ms_closes_a_turn_that_never_pauses(sentence: Utterance) -> None:
    detector = TurnDetector(TurnDetection(), max_turn_ms=1000)
    events = run(detector, sentence.audio)
    stopped = events[1]
    assert isinstance(stopped, SpeechStopped) and stopped.forced
    assert 1000 <= stopped.end_ms - stopped.padded_start_ms < 1000 + 32
    assert len(stopped.audio) == (stopped.end_ms - stopped.padded_start_ms) * RATE // 1000


def test_reset_forgets_everything(detector: TurnDetector, sentence: Utterance) -> None:
    fresh = [(type(e), e.start_ms) for e in run(TurnDetector(), sentence.audio)]
    detector.process(sentence.audio[: len(sentence.audio) // 2])
    detector.threshold_override = 0.7
    detector.reset()
    assert (detector.position_ms, detector.in_speech, detector.probability) == (0, False, 0.0)
    detector.threshold_override = None
    assert [(type(e), e.start_ms) for e in run(detector, sentence.audio)] == fresh


def test_sessions_sharing_the_model_keep_their_own_state(sentence: Utterance) -> None:
    other = utterance("A completely different sentence spoken at another time.", lead_s=0.3)
    alone = (TurnDetector().process(sentence.audio), TurnDetector().process(other.audio))
    first, second = TurnDetector(), TurnDetector()
    together: tuple[list, list] = ([], [])
    for start in range(0, max(len(sentence.audio), len(other.audio)), 320):
        together[0].extend(first.process(sentence.audio[start : start + 320]))
        together[1].extend(second.process(other.audio[start : start + 320]))
    for mixed, single in zip(together, alone):
        assert [(type(e), e.start_ms, getattr(e, "end_ms", 0)) for e in mixed] == [
            (type(e), e.start_ms, getattr(e, "end_ms", 0)) for e in single
        ]


def test_torch_thread_count_survives_silero_import() -> None:
    code = ("import torch; torch.set_num_threads(3); from duplex.turns.vad import VadStream; "
            "VadStream(); print(torch.get_num_threads())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "3"
