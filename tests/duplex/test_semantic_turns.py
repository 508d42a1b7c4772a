"""semantic_vad in the session, on virtual time with the real VAD and the real end-of-turn model:
a pause inside an unfinished sentence does not end the turn, a finished question does, and the
maximum wait ends a turn the model doubts. The toy pipeline answers (in-process).

The answer begun at each pause (speculation): aborted without a trace when the user goes on (a
slow toy, so that the abort finds it running), adopted when the turn ends there, and its
transcript read as the pause's words (a scripted pipeline, so that the test says what was heard).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from duplex.media.paced_track import OutboundAudioTrack
from duplex.media.playout import PacedPlayout
from duplex.session.model_pipeline import ModelPipeline
from duplex.session.session import Session
from duplex.settings import SessionDefaults
from duplex.turns import end_of_turn
from duplex.turns.config import TurnDetection
from duplex.turns.semantic_policy import MAX_WAIT_MS, MIN_SILENCE_MS, WORDS_AT_MS, Eagerness, patience
from duplex.turns.server_vad import TurnDetector
from harness.scripted_pipeline import RATE, ScriptedPipeline
from harness.speech import speech, speech_with_pauses
from pipeline.config import parse_pipeline_config, read_yaml
from pipeline.coordinator import Coordinator
from pipeline.runner import start_pipeline

ROOT = Path(__file__).resolve().parents[2]
STEP = 320  # 20 ms at 16 kHz
LOUD = 0.004  # |sample| above this is sound (espeak pads its output with digital silence)
# How far inside the maximum wait a turn the model ends must end: a model that doubts every turn
# ends it at the maximum wait counted from where the VAD found the pause, which may lie ~100 ms
# before the last voiced sample (espeak's quiet last phoneme).
MARGIN_MS = 300
DOUBT_MS = 10_000  # the most audio time a test feeds while it waits for anything


def last_voiced_ms(audio: np.ndarray) -> int:
    """Audio time of a clip's last voiced sample (clips carry a quiet tail)."""
    return int(np.flatnonzero(np.abs(audio) > LOUD)[-1]) * 1000 // 16000


ORDER = ("I would like to order a large pizza with", "mushrooms and olives.")
QUESTION = "Could you tell me what the weather will be like tomorrow?"


class Caller:
    """A session on semantic_vad whose transport records events; audio fed 20 ms a step."""

    kind = "webrtc"

    def __init__(self, pipeline: ModelPipeline, eagerness: str = "auto", **defaults: Any) -> None:
        self.events: list[dict] = []
        self.clock = 0.0
        self.track = OutboundAudioTrack(clock=lambda: self.clock)
        self.session = Session("sess_semantic", self, PacedPlayout(self.track), pipeline,
                               SessionDefaults(**defaults), ["default"], "toy")
        td = replace(TurnDetection(), type="semantic_vad", eagerness=eagerness)
        self.session.reconfigure(replace(self.session.config, turn_detection=td))
        self.ms = 0  # audio fed so far
        self.committed_at: list[int] = []  # audio time of each committed turn

    def send_event(self, event: dict) -> None:
        self.events.append(event)
        if event["type"] == "input_audio_buffer.committed":
            self.committed_at.append(self.ms)

    async def feed(self, audio: np.ndarray) -> None:
        for i in range(0, len(audio) - STEP + 1, STEP):
            self.session.on_audio(audio[i : i + STEP])
            self.ms += 20
            await self.session.settled()  # audio time waits for the model, as if it were instant
            self.clock += 0.02
            await self.track.recv()

    async def silence(self, ms: int) -> None:
        await self.feed(np.zeros(ms * 16, dtype=np.float32))

    async def until(self, condition: Any, what: str, within_ms: int = DOUBT_MS) -> None:
        """Silence 20 ms a step until ``condition()`` holds; fail after ``within_ms`` of audio."""
        start = self.ms
        while not condition():
            assert self.ms - start < within_ms, f"no {what} after {within_ms} ms of silence"
            await self.silence(20)
            await asyncio.sleep(0)  # let the session's tasks take what the pipeline pushed


async def order_with_a_pause(caller: Caller) -> int:
    """The unfinished sentence with its 900 ms pause, fed whole: its last voiced sample's time."""
    start = caller.ms
    turn = speech_with_pauses(ORDER, (900,), pad_before_s=0.3, pad_after_s=0.0)
    await caller.feed(turn)
    assert caller.committed_at == [], "answered into the pause"
    return start + last_voiced_ms(turn)


async def finished_question(caller: Caller) -> int:
    """The finished question, fed whole: its last voiced sample's time."""
    start = caller.ms
    question = speech(QUESTION, 16000, 0.3, 0.0)
    await caller.feed(question)
    return start + last_voiced_ms(question)


async def test_a_pause_inside_an_unfinished_sentence_does_not_end_the_turn(pipeline: Coordinator) -> None:
    """The pause does not end the turn (a model sure of every pause would), and the sentence's own
    end does, well before the maximum wait counted from its last word (a model that doubts every
    pause would wait it out)."""
    caller = Caller(pipeline)
    last_word = await order_with_a_pause(caller)
    await caller.until(lambda: caller.committed_at, "end of turn", MAX_WAIT_MS[Eagerness.MEDIUM] + 500)
    await caller.silence(500)
    assert len(caller.committed_at) == 1
    assert caller.committed_at[0] - last_word < MAX_WAIT_MS[Eagerness.MEDIUM] - MARGIN_MS, \
        (caller.committed_at, last_word)
    await caller.session.close()


async def test_a_finished_question_ends_the_turn_before_the_maximum_wait(pipeline: Coordinator) -> None:
    """On high eagerness a finished question ends well before the maximum wait counted from its last
    word (a doubting model would wait it out), and the same eagerness still waits through the
    unfinished sentence's pause (a model sure of every pause would cut it)."""
    caller = Caller(pipeline, eagerness="high")
    last_word = await finished_question(caller)
    await caller.until(lambda: caller.committed_at, "end of turn", MAX_WAIT_MS[Eagerness.HIGH] + 500)
    await caller.silence(500)
    assert len(caller.committed_at) == 1
    assert caller.committed_at[0] - last_word < MAX_WAIT_MS[Eagerness.HIGH] - MARGIN_MS, \
        (caller.committed_at, last_word)
    await caller.until(lambda: "response.created" in [e["type"] for e in caller.events], "response")
    await caller.session.close()
    caller = Caller(pipeline, eagerness="high")
    await order_with_a_pause(caller)
    await caller.session.close()


async def test_the_maximum_wait_ends_every_turn(pipeline: Coordinator,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that doubts every turn: the maximum wait of each eagerness ends it, counted from the
    last word (not sooner, not later)."""
    monkeypatch.setattr(end_of_turn.EndOfTurnModel, "probability", lambda self, audio: 0.0)
    for eagerness in ("high", "low"):
        limit = MAX_WAIT_MS[Eagerness(eagerness)]
        caller = Caller(pipeline, eagerness=eagerness)
        turn = speech_with_pauses(("My number is five five five",), (), pad_before_s=0.3, pad_after_s=0.0)
        await caller.feed(turn)
        last_word = last_voiced_ms(turn)
        await caller.until(lambda c=caller: c.committed_at, "end of turn", limit + 500)
        await caller.silence(200)
        assert len(caller.committed_at) == 1, eagerness
        assert limit - MARGIN_MS < caller.committed_at[0] - last_word <= limit + 200, \
            (eagerness, caller.committed_at, last_word)
        await caller.session.close()


def speculative(outcome: str) -> float:
    value = REGISTRY.get_sample_value("duplex_speculative_responses_total", {"outcome": outcome})
    assert value is not None, "duplex_speculative_responses_total is not exported"
    return value


@pytest.fixture(scope="module")
async def slow_pipeline() -> AsyncIterator[Coordinator]:
    """The toy pipeline with a 4 s answer: still running when the user goes on."""
    preset = read_yaml(ROOT / "configs" / "toy.yaml")["pipeline"]
    thinker = next(stage for stage in preset["stages"] if stage["name"] == "thinker")
    thinker["options"] = {"answer_tokens": 200, "step_delay_s": 0.02}
    thinker["max_new_tokens"] = 256
    coordinator = await start_pipeline(parse_pipeline_config(preset), mode="inproc")
    yield coordinator
    await coordinator.close()


async def test_an_answer_begun_in_a_pause_is_aborted_without_a_trace_when_the_user_goes_on(
        slow_pipeline: Coordinator) -> None:
    caller = Caller(slow_pipeline)
    aborted, adopted = speculative("aborted"), speculative("adopted")
    first, rest = "I would like to order a large pizza with", "mushrooms and olives."
    await caller.feed(speech_with_pauses((first,), (), pad_before_s=0.3, pad_after_s=0.0))
    await caller.silence(600)
    # The speculative answer runs in every stage, and nothing of it has reached the client.
    stats = await slow_pipeline.stage_stats()
    assert slow_pipeline.requests_in_flight == 1
    assert stats["thinker"].live_requests == 1, stats
    assert not [e for e in caller.events if e["type"].startswith(("response.", "conversation."))]
    assert caller.session.history.items == []
    await caller.feed(speech_with_pauses((rest,), (), pad_before_s=0.0, pad_after_s=0.0))
    assert speculative("aborted") == aborted + 1
    await caller.silence(MAX_WAIT_MS[Eagerness.MEDIUM] + 200)
    assert len(caller.committed_at) == 1
    assert [e["type"] for e in caller.events].count("response.created") == 1
    assert speculative("adopted") == adopted + 1
    assert [item.role for item in caller.session.history.items] == ["user", "assistant"]
    await caller.session.close()
    stats = await slow_pipeline.stage_stats()
    assert slow_pipeline.requests_in_flight == 0
    assert all(s.live_requests == 0 for s in stats.values()), stats


async def _commit_time(transcript: str, finished: float | None = None
                       ) -> tuple[int, Caller, ScriptedPipeline]:
    """Audio ms of the pause (where the VAD found it) until the turn is committed, when the
    speculative request's recogniser heard ``transcript`` (and judged it ``finished``, if given);
    the answer's chunks come before the turn ends."""
    pipeline = ScriptedPipeline()
    caller = Caller(pipeline, eagerness="high")
    question = speech("What is the capital of France?", 16000, 0.3, 0.0)
    vad = TurnDetector(TurnDetection(silence_duration_ms=10_000))
    vad.process(np.concatenate([question, np.zeros(16000, np.float32)]))
    await caller.feed(question)
    await caller.until(lambda: pipeline.requests, "request")
    assert pipeline.requests[0].params["end_of_turn"] is True  # the pipeline may judge the words
    pipeline.push(input_transcript=transcript,
                  **({} if finished is None else {"input_end_of_turn": finished}))
    pipeline.push(text="Paris.", audio=np.full(RATE // 10, 0.1, np.float32), sample_rate=RATE)
    await caller.until(lambda: caller.committed_at, "end of turn")
    return caller.committed_at[0] - vad.pause_start * 1000 // 16000, caller, pipeline


async def test_the_answer_is_begun_when_the_pause_reaches_the_words_ask_before_any_decision() -> None:
    """The speculative request (whose words the decision weighs) goes out at ``WORDS_AT_MS`` of
    the VAD's silence, so that its words are in by the time a decision may fall."""
    pipeline = ScriptedPipeline()
    caller = Caller(pipeline, eagerness="high")
    question = speech("What is the capital of France?", 16000, 0.3, 0.0)
    vad = TurnDetector(TurnDetection(silence_duration_ms=10_000))
    vad.process(np.concatenate([question, np.zeros(16000, np.float32)]))
    for start in range(0, len(question) - STEP + 1, STEP):  # espeak's own trailing silence too
        await caller.feed(question[start : start + STEP])
        await asyncio.sleep(0)  # the speculation's task submits its request
        if pipeline.requests:
            break
    await caller.until(lambda: pipeline.requests, "request")
    silence_ms = caller.ms - vad.pause_start * 1000 // 16000
    assert WORDS_AT_MS <= silence_ms < WORDS_AT_MS + 64 < MIN_SILENCE_MS, silence_ms
    assert caller.committed_at == []
    pipeline.end()
    await caller.session.close()


async def test_the_words_of_the_pause_hold_an_unfinished_turn_and_the_adopted_answer_replays() -> None:
    held, caller, pipeline = await _commit_time("I would like a large pizza and")
    # Words that cannot end a sentence: only the maximum wait ends the turn (a commit is recorded
    # at the start of the 20 ms step that brought it).
    assert held + STEP // 16 >= MAX_WAIT_MS[Eagerness.HIGH], held
    quick, other, other_pipeline = await _commit_time("What is the capital of France?")
    assert quick < held
    for c, p in ((caller, pipeline), (other, other_pipeline)):
        p.end()
        await c.until(lambda c=c: "response.done" in [e["type"] for e in c.events], "response.done")
        # One request, adopted: what came before the turn ended is replayed in order.
        assert len(p.requests) == 1 and p.aborted == []
        types = [e["type"] for e in c.events]
        assert types.index("input_audio_buffer.committed") < types.index("response.created") \
            < types.index("conversation.item.input_audio_transcription.completed") \
            < types.index("response.output_audio_transcript.delta")
        done = next(e for e in c.events if e["type"] == "response.done")
        assert done["response"]["status"] == "completed"
        assert done["response"]["output"][0]["content"][0]["transcript"] == "Paris."
        await c.session.close()


async def test_words_the_pipeline_judges_finished_end_the_turn_at_the_first_ask() -> None:
    sure, *rest = await _commit_time("What is the capital of France?", finished=0.7)
    doubtful, *more = await _commit_time("What is the capital of France?", finished=0.0001)
    # The ask comes at MIN_SILENCE_MS of the VAD's silence (its lag after the pause's start
    # besides): the judged words end the turn there, where words judged to go on leave it to the
    # audio's doubt until the bar has fallen, past the hold.
    rule = patience(Eagerness.HIGH)
    assert sure < MIN_SILENCE_MS + 200 < rule.hold_ms < doubtful, (sure, doubtful)
    for caller, pipeline in (rest, more):
        pipeline.end()
        await caller.session.close()


async def test_kept_model_state_continues_through_an_aborted_and_an_adopted_speculation() -> None:
    """With keep_model_state, the answer begun in a mid-sentence pause continues the kept
    conversation and its abort leaves it as it was; the adopted one's audio is the turn's, so the
    next turn continues the same conversation (nothing closed, no fresh prefill)."""
    pipeline = ScriptedPipeline()
    caller = Caller(pipeline, eagerness="high", keep_model_state=True)

    async def answered_turn(audio: np.ndarray, turn: int) -> None:
        # No transcript: the presets that keep model state (Qwen3-Omni) do not transcribe.
        await caller.feed(audio)
        await caller.until(lambda: len(caller.committed_at) >= turn, "end of turn")
        pipeline.push(text="Sure.", audio=np.full(RATE // 10, 0.1, np.float32), sample_rate=RATE)
        pipeline.end()
        await caller.until(lambda: [e["type"] for e in caller.events].count("response.done") >= turn,
                           "response.done")

    order = speech_with_pauses(("I would like to order a large pizza with", "mushrooms and olives."),
                               (900,), pad_before_s=0.3, pad_after_s=0.0)
    await answered_turn(order, 1)
    await answered_turn(speech("What is the capital of France?", 16000, 0.3, 0.0), 2)
    first, adopted, second = pipeline.requests[0], pipeline.requests[1], pipeline.requests[-1]
    assert pipeline.aborted[:1] == [first.request_id]
    conversation = first.params["conversation_id"]
    assert adopted.params["conversation_id"] == second.params["conversation_id"] == conversation
    assert pipeline.closed_conversations == []
    # The second turn's request extends the adopted one's messages with its answer and the turn.
    messages = second.inputs["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[:2] == adopted.inputs["messages"]
    assert messages[1]["audio"] is adopted.inputs["messages"][-1]["audio"]
    await caller.session.close()
    assert pipeline.closed_conversations == [conversation]


async def test_without_speculative_start_nothing_is_asked_before_the_decision() -> None:
    """``speculative_start: false`` (a preset's session default): the model is asked once, after
    the end-of-turn decision, as under server_vad."""
    pipeline = ScriptedPipeline()
    caller = Caller(pipeline, eagerness="high", speculative_start=False)
    await caller.feed(speech("What is the capital of France?", 16000, 0.3, 0.0))

    def decided() -> bool:
        if caller.committed_at:
            return True
        assert pipeline.requests == [], "asked before the decision"
        return False

    await caller.until(decided, "end of turn")
    await caller.until(lambda: pipeline.requests, "request")
    assert len(pipeline.requests) == 1 and pipeline.aborted == []
    await caller.session.close()
