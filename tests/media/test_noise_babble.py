"""Babble (several people talking at once, espeak-ng voices: harness/noise.py) 10 dB below a
caller's question, in a real Session (real VAD and turn detection; a scripted pipeline fake stands
in for the model), and what the offline preset's recogniser (Whisper tiny.en) makes of the turn.

Babble is speech: with or without WebRTC's suppressor the VAD starts a turn in the babble alone
and never ends it. ``near_field``'s talk gate (duplex/media/talk_gate.py) keeps it out: no turn in
the noise alone, one turn for the question, and its words recognised (WER <= 0.35).
"""

from __future__ import annotations

import numpy as np
import pytest

from duplex.media.talk_gate import HOLD_S, MIN_HISTORY_S, TalkGate
from harness.noise import babble, under, white_noise
from harness.speech import natural_speech
from harness.wer import wer
from pipeline.models.offline.asr import Transcriber
from tests.media.test_front_end_session import RATE, Host

QUESTIONS = ("What time does the library open tomorrow morning?",
             "Can you remind me to call my mother on Friday?")
ALONE_S = 4.0  # the noise alone before the caller speaks
SNR_DB = 10.0


async def noisy_question(question: str, noise: np.ndarray, reduction: str | None,
                         transcriber: Transcriber) -> tuple[int, int, float, int]:
    """The noise alone for ALONE_S, then the question in it: (turns started in the noise alone,
    turns committed, WER of the last user turn's transcript, 10 ms frames the talk gate muted)."""
    host = Host(turn_detection={"type": "server_vad", "create_response": False})
    host.update({"noise_reduction": None if reduction is None else {"type": reduction}})
    speech = natural_speech(question, RATE, ALONE_S, 1.0)
    heard = speech + under(speech, noise, SNR_DB)
    alone = int(ALONE_S * RATE)
    host.feed(heard[:alone])
    false_starts = len(host.of("input_audio_buffer.speech_started"))
    host.feed(heard[alone:], start=ALONE_S)
    turns = [item for item in host.session.history.items if item.role == "user"]
    text = transcriber.transcribe(turns[-1].audio, RATE) if turns else ""
    gate = host.session.front_end.gate
    muted = 0 if gate is None else gate.muted_frames
    await host.session.close()
    assert host.session.front_end.gate is None  # let go of with the session
    return false_starts, len(host.of("input_audio_buffer.committed")), wer(question, text), muted


@pytest.mark.parametrize("question", QUESTIONS)
async def test_near_field_keeps_babble_from_the_vad_and_the_words_through(
        question: str, transcriber: Transcriber) -> None:
    noise = babble(12.0, voices=6)
    false_starts, committed, error, muted = await noisy_question(question, noise, "near_field",
                                                                 transcriber)
    assert false_starts == 0
    assert committed == 1
    assert error <= 0.35, error
    assert muted > ALONE_S * 100 / 2  # the babble alone, most of it


async def test_without_noise_reduction_babble_starts_a_turn_that_never_ends(
        transcriber: Transcriber) -> None:
    """What the gate is for: the same babble without noise_reduction (and with WebRTC's suppressor
    alone, far_field) is speech to the VAD."""
    for reduction in (None, "far_field"):
        false_starts, committed, _, _ = await noisy_question(QUESTIONS[0], babble(12.0, voices=6),
                                                             reduction, transcriber)
        assert (false_starts, committed) == (1, 0), reduction


async def test_near_field_leaves_a_caller_in_steady_noise_alone(transcriber: Transcriber) -> None:
    """White noise is not talk: past MIN_HISTORY_S (until the background is known) the gate mutes
    nothing, the caller's words included (the suppressor deals with such noise)."""
    false_starts, committed, _, muted = await noisy_question(
        QUESTIONS[1], white_noise(12.0, RATE), "near_field", transcriber)
    assert (false_starts, committed) == (0, 1)
    assert muted <= MIN_HISTORY_S * 100


def level(db: float) -> np.ndarray:
    """10 ms at ``db`` dB full scale."""
    return np.full(160, 10 ** (db / 20), np.float32)


def test_the_gate_opens_for_a_caller_well_above_the_talk_and_holds_through_words() -> None:
    """The gate alone, on frames whose levels are known: babble-like levels (spread evenly over
    12 dB, the background ~-35.6 dB) are muted once learnt; a caller 20 dB above them opens it on
    the third loud frame; quieter frames after (consonants, between HOLD_DB and OPEN_DB above
    the background) keep it open longer than HOLD_S, and it closes HOLD_S after the last."""
    rng = np.random.default_rng(1)
    gate = TalkGate()
    out = [gate.process(f, f) for f in (level(rng.uniform(-38, -26)) for _ in range(200))]
    assert not np.any(out[-1]) and gate.muted_frames > 150
    first, second, third = (gate.process(f, f) for f in (level(-15),) * 3)
    assert not np.any(first) and not np.any(second)
    assert third[-1] == pytest.approx(level(-15)[-1])
    soft = level(-26.5)
    held = [gate.process(soft, soft) for _ in range(round(2 * HOLD_S * 100))]
    assert all(np.array_equal(f, soft) for f in held)
    quiet = level(-36)
    after = [gate.process(quiet, quiet) for _ in range(round(HOLD_S * 100) + 2)]
    assert sum(np.array_equal(f, quiet) for f in after) == round(HOLD_S * 100) - 1
    assert not np.any(after[-1])


def test_the_gate_mutes_a_talk_like_start_until_it_knows_the_background() -> None:
    """A loud burst 100 ms into the audio, over levels that already look like talk (spread over
    12 dB): muted, since MIN_HISTORY_S of background are not known yet; the same burst after that
    opens the gate."""
    talk = [level(db) for db in (-38, -32, -26, -35, -29)]
    gate = TalkGate()
    for i in range(10):
        gate.process(talk[i % 5], talk[i % 5])
    early = [gate.process(f, f) for f in (level(-12),) * 5]
    assert not any(np.any(f) for f in early)
    for i in range(round(MIN_HISTORY_S * 100)):
        gate.process(talk[i % 5], talk[i % 5])
    late = [gate.process(f, f) for f in (level(-12),) * 5]
    assert np.any(late[-1])
