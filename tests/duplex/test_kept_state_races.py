"""The kept model state (``keep_model_state``) when a speculative answer is withdrawn late: after
another request of the conversation was built, the kept state must stay that newer request's, so
that what comes next (new instructions) is seen and the stale state is not continued; after the
speculative request itself finished, the stages must still undo its turn.

The session on semantic_vad with speculative answers (the helpers of test_semantic_turns.py), a
scripted pipeline (a fake) that says what was asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from duplex.session.speculation import Speculation
from harness.scripted_pipeline import RATE, ScriptedPipeline
from harness.speech import speech, speech_with_pauses
from pipeline.coordinator import Coordinator
from pipeline.proto import Abort
from tests.duplex.test_semantic_turns import Caller
from tests.pipeline.test_unacknowledged_abort import FakeThinker, pipeline, request, resumed

__all__ = ["pipeline"]  # the fixture, imported for pytest to find


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.001)


async def _answered(caller: Caller, pipeline: ScriptedPipeline, audio: np.ndarray, turn: int) -> None:
    await caller.feed(audio)
    while len(caller.committed_at) < turn:
        await caller.silence(20)
    pipeline.push(text="Sure.", audio=np.full(RATE // 10, 0.1, np.float32), sample_rate=RATE)
    pipeline.end()
    while [e["type"] for e in caller.events].count("response.done") < turn:
        await caller.silence(20)


async def test_new_instructions_after_a_response_created_during_a_speculation_start_afresh() -> None:
    pipeline = ScriptedPipeline()
    caller = Caller(pipeline, eagerness="high", keep_model_state=True)
    session = caller.session
    await _answered(caller, pipeline, speech("What is the capital of France?", 16000, 0.3, 0.0), 1)
    # A pause mid-sentence: an answer is speculated.
    n = len(pipeline.requests)
    await caller.feed(speech_with_pauses(("I would like to order a large pizza with",), (),
                                         pad_before_s=0.3, pad_after_s=0.0))
    while len(pipeline.requests) == n or pipeline.requests[-1].request_id in pipeline.aborted:
        await caller.silence(20)
    speculative = pipeline.requests[-1]
    assert speculative.params.get("end_of_turn") is True
    # The client asks for a response meanwhile; the speculation is dropped at the next window.
    session.start_response()
    await caller.silence(20)
    assert speculative.request_id in pipeline.aborted
    created = pipeline.requests[-1]
    assert session.response is not None and session.response.request_id == created.request_id
    pipeline.end(created.request_id)
    # No audio meanwhile: the user's turn (still in its pause) neither ends nor is answered.
    await until(lambda: session.response is None)
    # New instructions: the next request cannot continue a state prefilled with the old ones.
    session.reconfigure(replace(session.config, instructions="Answer like a pirate."))
    session.start_response()
    await until(lambda: pipeline.requests[-1].request_id == session.response.request_id)
    following = pipeline.requests[-1]
    assert following.inputs["messages"][0]["text"].startswith("Answer like a pirate.")
    assert following.params["conversation_id"] != created.params["conversation_id"]
    assert created.params["conversation_id"] in pipeline.closed_conversations
    pipeline.end(following.request_id)
    await session.close()


@pytest.mark.xfail(strict=True, reason="pipeline/coordinator.py: a plain abort of an ended request "
                   "sends nothing to the stages (see the test's doc)")
async def test_a_speculation_that_finished_before_its_abort_leaves_the_stages_as_before_it(
        pipeline: tuple[Coordinator, FakeThinker]) -> None:
    """The speculative answer was all generated (it waited, buffered, for the turn's end) when the
    user went on: its abort must undo its turn in the stages that keep the conversation, as the
    session's kept state is told (``withdraw``), so that the next turn continues the state from
    before it. The coordinator's own pipeline with one stage played by the test (keeping
    conversations: tests/pipeline/test_unacknowledged_abort.py)."""
    coordinator, stage = pipeline
    async for _ in coordinator.stream(request("r1", "one")):
        pass
    assert not await resumed(stage)
    speculation = Speculation(coordinator, request("s", "one", "answer", "two so"), np.zeros(1, np.float32),
                              0, lambda *_: None, {"session_id": "sess_test"})
    assert await resumed(stage)
    await until(lambda: speculation._task.done())  # the stream ended: the request is done
    await speculation.abort()
    assert any(isinstance(m, Abort) and m.request_id == "s" for m in stage.seen), \
        "the abort of the finished speculation reached no stage"
    async for _ in coordinator.stream(request("r2", "one", "answer", "two so far")):
        pass
    assert await resumed(stage), "the next turn did not continue the state from before the speculation"
