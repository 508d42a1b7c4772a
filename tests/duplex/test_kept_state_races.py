"""The kept model state (``keep_model_state``) when a speculative answer is withdrawn late: after
another request of the conversation was built, the kept state must stay that newer request's, so
that what comes next (new instructions) is seen and the stale state is not continued; after the
speculative request itself finished, the stages must still undo its turn (``Coordinator.withdraw``;
the next turn waits for that undo, and where the turn cannot be undone the conversation's kept
state is dropped).

The session on semantic_vad with speculative answers (the helpers of test_semantic_turns.py), a
scripted pipeline (a fake) that says what was asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from duplex.session.model_state import KeptModelState
from duplex.session.speculation import Speculation
from harness.scripted_pipeline import RATE, ScriptedPipeline
from harness.speech import speech, speech_with_pauses
from pipeline.coordinator import Coordinator
from pipeline.proto import Abort, DropConversation
from pipeline.scheduling.conversation_book import SESSION_PARAM
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


async def test_the_next_turn_waits_for_the_undo_of_a_withdrawn_turn(
        pipeline: tuple[Coordinator, FakeThinker]) -> None:
    """The next request comes while the withdrawn turn's undo is being acknowledged: it waits for
    it, then continues the state from before the withdrawn turn."""
    coordinator, stage = pipeline
    for rid, texts in (("r1", ("one",)), ("s", ("one", "answer", "two so"))):
        async for _ in coordinator.stream(request(rid, *texts)):
            pass
    await stage.submits.get()
    await stage.submits.get()
    withdrawing = asyncio.create_task(coordinator.withdraw("s"))
    await asyncio.sleep(0)  # the undo is sent
    async for _ in coordinator.stream(request("r2", "one", "answer", "two so far")):
        pass
    await withdrawing
    assert await resumed(stage)
    undo = next(i for i, m in enumerate(stage.seen) if isinstance(m, Abort) and m.request_id == "s")
    assert undo < next(i for i, m in enumerate(stage.seen) if getattr(m, "payload", None) is not None
                       and m.payload.request_id == "r2")


async def test_a_withdrawn_turn_that_cannot_be_undone_drops_the_conversation(
        pipeline: tuple[Coordinator, FakeThinker]) -> None:
    """A later turn was built on the withdrawn one, or a stage did not acknowledge the undo: the
    kept state is dropped and the next turn is a full prefill."""
    coordinator, stage = pipeline
    turns = (("one",), ("one", "answer", "two"), ("one", "answer", "two", "ans", "three"))
    for i, texts in enumerate(turns[:2]):
        async for _ in coordinator.stream(request(f"r{i}", *texts)):
            pass
    await coordinator.withdraw("r0")  # r1 continued it
    await until(lambda: DropConversation("c", None) in stage.seen)
    fourth = (*turns[2], "ans", "four")
    for rid, texts in (("r2", turns[2]), ("r3", fourth)):
        async for _ in coordinator.stream(request(rid, *texts)):
            pass
    for _ in range(2):
        await stage.submits.get()
    assert [await resumed(stage), await resumed(stage)] == [False, True]
    stage.seen.clear()
    stage.silent = True
    await asyncio.wait_for(coordinator.withdraw("r3"), 5)  # by the abort's timeout
    stage.silent = False
    assert any(isinstance(m, Abort) and m.request_id == "r3" for m in stage.seen)
    await until(lambda: DropConversation("c", None) in stage.seen)
    async for _ in coordinator.stream(request("r4", *fourth)):  # r2's state is not vouched for
        pass
    assert not await resumed(stage)


async def test_a_cut_that_is_not_token_exact_keeps_a_cache_only_conversation() -> None:
    """Where stages only cache per conversation (the offline LM), a truncation that names no
    answer tokens keeps the conversation: nothing is closed, and the next request continues the
    same one. Where a stage keeps state, the same cut drops it (the next turn starts afresh)."""
    for keeps in (False, True):
        pipeline = ScriptedPipeline()
        pipeline.keeps_conversations = keeps
        state = KeptModelState(pipeline, enabled=True)
        first = [{"role": "user", "text": "Tell me a story.", "audio": None}]
        cid = state.conversation_for(first, request_id="r1")[SESSION_PARAM]
        state.answered("r1", "answer-1")
        assert state.cut("answer-1", None) is None
        await asyncio.sleep(0)  # a close, where there is one, runs on the loop
        after = [*first, {"role": "assistant", "text": "Once upon", "audio": None},
                 {"role": "user", "text": "Stop.", "audio": None}]
        again = state.conversation_for(after, request_id="r2")[SESSION_PARAM]
        assert (again == cid) is not keeps
        assert pipeline.closed_conversations == ([cid] if keeps else [])
