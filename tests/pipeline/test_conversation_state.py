"""Kept conversation state in the pipeline core, model-free: the ``ar`` scheduler's kept state
(start, keep, roll back, cut, drop) with a fake ConversationRunner, and the coordinator's book
(what a request continues, how turns end, evictions under a budget)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from pipeline.proto import OmniRequest, StagePayload
from pipeline.scheduling.ar import ARScheduler
from pipeline.scheduling.base import ARSlot, ARStepResult, RequestError, RequestFailure
from pipeline.scheduling.conversation_book import Budget, ConversationBook

ANSWER = 4


@dataclass
class Kept:
    ids: list[int]
    base: int
    answer_start: int


@dataclass
class State:
    prompt: list[int]
    base: int = 0
    answer: list[int] = field(default_factory=list)
    past: Kept | None = None


class Runner:
    """Prompts are lists of ints; the answer is ANSWER tokens counting up from the prompt's sum."""

    def __init__(self) -> None:
        self.fail_next = False
        self.dropped: list[Kept] = []

    def new_state(self, payload: StagePayload) -> State:
        return State(list(payload.data["ids"]))

    def resume(self, kept: Kept, payload: StagePayload) -> State:
        if payload.data.get("bad"):
            raise RequestError(payload.request_id, "bad input")
        return State(kept.ids + list(payload.data["ids"]), base=len(kept.ids), past=kept)

    def feed(self, slot: ARSlot, payload: StagePayload) -> None: ...

    def close_input(self, slot: ARSlot, payload: StagePayload) -> None: ...

    def runnable(self, slot: ARSlot) -> bool:
        return True

    def output_cap(self, slot: ARSlot) -> int | None:
        return None

    def step(self, slots: list[ARSlot]) -> list[ARStepResult]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("forward failed")
        out = []
        for slot in slots:
            st: State = slot.state
            st.answer.append(sum(st.prompt) + len(st.answer))
            out.append(ARStepResult({"token": st.answer[-1]}, finished=len(st.answer) == ANSWER))
        return out

    def finish(self, slot: ARSlot, capped: bool) -> dict[str, Any] | None:
        return None

    def release(self, slot: ARSlot) -> None:
        slot.state = None

    def started(self, slot: ARSlot) -> bool:
        return bool(slot.state.answer)

    def keep(self, slot: ARSlot) -> Kept | None:
        st: State = slot.state
        if st.past is not None and not st.answer:
            return Kept(st.past.ids, len(st.past.ids), len(st.past.ids))
        if not st.answer and st.base == 0:
            return None
        return Kept(st.prompt + st.answer, st.base, len(st.prompt))

    def truncate(self, kept: Kept | None, answer_tokens: int | None) -> Kept | None:
        if kept is None:
            return None
        if answer_tokens is None:
            return Kept(kept.ids[: kept.base], kept.base, kept.base) if kept.base else None
        return Kept(kept.ids[: kept.answer_start + answer_tokens], kept.base, kept.answer_start)

    def kept_bytes(self, kept: Kept) -> int:
        return 8 * len(kept.ids)

    def drop(self, kept: Kept) -> None:
        self.dropped.append(kept)


def request(rid: str, ids: list[int], cid: str | None = "c", resume: bool = False, **data: Any) -> StagePayload:
    params = {} if cid is None else {"conversation": {"id": cid, "resume": resume}}
    return StagePayload(rid, {"ids": ids, **data}, params)


def run(scheduler: ARScheduler) -> list[Any]:
    outputs = []
    while scheduler.has_work():
        outputs += scheduler.step()
    return outputs


@pytest.fixture
def runner() -> Runner:
    return Runner()


@pytest.fixture
def scheduler(runner: Runner) -> ARScheduler:
    return ARScheduler(runner, max_batch=4, max_new_tokens=100, cap_param=None)


def kept_ids(scheduler: ARScheduler, cid: str = "c") -> list[int]:
    return scheduler._kept._kept[cid].state.ids  # type: ignore[union-attr]


def test_turns_continue_the_kept_state(scheduler: ARScheduler) -> None:
    assert scheduler.keeps_conversations
    scheduler.add(request("r1", [1, 2]))
    run(scheduler)
    assert scheduler.live_requests() == 0
    assert kept_ids(scheduler) == [1, 2, 3, 4, 5, 6]
    assert scheduler.conversation_sizes() == {"c": 48}
    scheduler.add(request("r2", [7], resume=True))
    assert scheduler.conversation_sizes() == {}  # the request holds it now
    run(scheduler)
    assert kept_ids(scheduler) == [1, 2, 3, 4, 5, 6, 7] + [28, 29, 30, 31]
    # A request outside any conversation keeps nothing.
    scheduler.add(request("r3", [1], cid=None))
    run(scheduler)
    assert set(scheduler.conversation_sizes()) == {"c"}


def test_abort_in_flight_rolls_back_or_keeps_what_was_heard(scheduler: ARScheduler) -> None:
    scheduler.add(request("r1", [1]))
    run(scheduler)
    before = kept_ids(scheduler)
    scheduler.add(request("r2", [5], resume=True))
    scheduler.step()
    scheduler.abort("r2")
    assert kept_ids(scheduler) == before and scheduler.live_requests() == 0
    scheduler.add(request("r3", [5], resume=True))
    scheduler.step()
    scheduler.step()
    assert scheduler.abort_conversation("r3", "c", 1) == "r3"
    assert kept_ids(scheduler) == before + [5, sum(before) + 5]  # prompt + 1 answer token
    # A cut of a request that had not begun here keeps the state as it was, made by r3 still.
    scheduler.add(request("r4", [6], resume=True))
    assert scheduler.abort_conversation("r4", "c", 3) == "r3"
    assert kept_ids(scheduler) == before + [5, sum(before) + 5]


def test_abort_after_finish_cuts_or_undoes_only_its_own_turn(scheduler: ARScheduler) -> None:
    scheduler.add(request("r1", [1]))
    run(scheduler)
    first = kept_ids(scheduler)
    scheduler.add(request("r2", [2], resume=True))
    run(scheduler)
    scheduler.abort_conversation("r1", "c", 0)  # not the request that made the state: ignored
    assert len(kept_ids(scheduler)) == len(first) + 1 + ANSWER
    answer = kept_ids(scheduler)[len(first) + 1 :]
    scheduler.abort_conversation("r2", "c", 2)
    assert kept_ids(scheduler) == first + [2] + answer[:2]
    scheduler.abort_conversation("r2", "c", None)
    assert kept_ids(scheduler) == first


def test_an_aborted_first_turn_leaves_nothing(scheduler: ARScheduler, runner: Runner) -> None:
    scheduler.add(request("r1", [1]))
    run(scheduler)
    scheduler.abort_conversation("r1", "c", None)
    assert scheduler.conversation_sizes() == {}
    scheduler.add(request("r2", [1]))
    scheduler.abort("r2")
    assert scheduler.conversation_sizes() == {}


def test_failures_roll_back(scheduler: ARScheduler, runner: Runner) -> None:
    scheduler.add(request("r1", [1]))
    run(scheduler)
    before = kept_ids(scheduler)
    scheduler.add(request("r2", [3], resume=True))
    scheduler.step()
    runner.fail_next = True
    (failure,) = scheduler.step()
    assert isinstance(failure, RequestFailure)
    assert kept_ids(scheduler) == before and scheduler.live_requests() == 0
    # A bad input fails before the state is taken over: it stays.
    with pytest.raises(RequestError):
        scheduler.add(request("r3", [1], resume=True, bad=True))
    assert kept_ids(scheduler) == before
    # Resuming what is not held is the request's error.
    with pytest.raises(RequestError, match="holds no state"):
        scheduler.add(request("r4", [1], cid="other", resume=True))


def test_drops_name_the_state_they_mean(scheduler: ARScheduler, runner: Runner) -> None:
    scheduler.add(request("r1", [1]))
    run(scheduler)
    scheduler.drop_conversation("c", "an-older-request")
    assert set(scheduler.conversation_sizes()) == {"c"}
    scheduler.drop_conversation("c", "r1")
    assert scheduler.conversation_sizes() == {} and len(runner.dropped) == 1
    # A request that starts a conversation afresh replaces what was kept.
    scheduler.add(request("r2", [1]))
    run(scheduler)
    scheduler.add(request("r3", [2]))
    run(scheduler)
    assert kept_ids(scheduler)[0] == 2 and len(runner.dropped) == 2


# --- the coordinator's book ---------------------------------------------------------------------


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "text": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "text": text}


def begin(book: ConversationBook, rid: str, messages: list[dict], cid: str = "c", **params: Any) -> OmniRequest:
    return book.begin(OmniRequest(rid, {"messages": messages}, {"conversation_id": cid, **params}))


def test_book_sends_only_what_is_new() -> None:
    book = ConversationBook()
    first = begin(book, "r1", [user("a")])
    assert first.params["conversation"] == {"id": "c", "resume": False}
    book.end("r1", "done", None)
    second = begin(book, "r2", [user("a"), assistant("x"), user("b")])
    assert second.params["conversation"]["resume"] and second.inputs["messages"] == [user("b")]
    # A second request while one is in flight keeps nothing.
    assert "conversation" not in begin(book, "r3", [user("z")]).params
    book.end("r2", "aborted", 3)  # barge-in: the cut turn is kept
    # A cut of a turn that had not begun in the stages: the state is the one from before it.
    begin(book, "r2b", [user("a"), assistant("x"), user("b"), assistant("y"), user("c")])
    book.end("r2b", "aborted", 2, turn_kept=False)
    third = begin(book, "r4", [user("a"), assistant("x"), user("b"), assistant("y"), user("c")])
    assert third.inputs["messages"] == [user("c")]
    book.end("r4", "aborted", None)  # undone: the state is the one before it
    again = begin(
        book, "r5", [user("a"), assistant("x"), user("b"), assistant("y"), user("d")],
        conversation_kept_messages=4,
    )
    assert again.inputs["messages"] == [user("d")]
    assert book.end("r5", "failed", None)  # a failure drops the state
    assert not begin(book, "r6", [user("a")]).params["conversation"]["resume"]


@pytest.mark.parametrize(
    "messages, claimed",
    [
        ([user("a"), user("b")], None),  # the answer is missing from the history
        ([user("a"), assistant("x")], None),  # nothing new
        ([user("a"), assistant("x"), user("b")], 5),  # the session counts otherwise
    ],
)
def test_book_falls_back_to_a_full_prefill(messages: list[dict], claimed: int | None) -> None:
    book = ConversationBook()
    begin(book, "r1", [user("a")])
    book.end("r1", "done", None)
    params = {} if claimed is None else {"conversation_kept_messages": claimed}
    again = begin(book, "r2", messages, **params)
    assert again.params["conversation"]["resume"] is False and again.inputs["messages"] == messages


def test_book_evicts_idle_conversations_least_recently_used_first() -> None:
    book = ConversationBook()
    for cid in ("a", "b", "c"):
        begin(book, f"{cid}1", [user("x")], cid=cid)
        book.end(f"{cid}1", "done", None)
    begin(book, "a2", [user("x"), assistant("y"), user("z")], cid="a")  # a is busy now
    sizes = {"a": 50, "b": 40, "c": 30, "gone": 5}
    drops = book.evictions(sizes, Budget(max_bytes=90, max_bytes_per_conversation=100))
    # "gone" has no record; b is the least recently used idle one; a is busy, never evicted.
    assert drops == [("gone", None), ("b", "b1")]
    assert book.last_request("b") is None and book.last_request("c") == "c1"
    assert book.evictions({"c": 30}, Budget(max_bytes=1000, max_bytes_per_conversation=20)) == [("c", "c1")]
    book.close("a")
    assert book.busy_request("a") is None


# --- turns prefilled while the user speaks (partial requests, open turns) ---------------------


def spoken(seconds: float) -> dict[str, Any]:
    return {"role": "user", "text": None, "audio": np.zeros(int(seconds * 16000), dtype=np.float32)}


def test_book_continues_an_open_turn_piece_by_piece_then_answers_it() -> None:
    book = ConversationBook()
    begin(book, "r1", [user("a")])
    book.end("r1", "done", None)
    turn = spoken(5)
    # The first piece continues the answered state: only the new turn is sent.
    first = begin(book, "p1", [user("a"), assistant("x"), turn], prefill_until_s=2)
    assert first.params["conversation"] == {"id": "c", "resume": True}
    assert first.inputs["messages"] == [turn]
    book.end("p1", "done", None)
    # The next piece and the answer say how much of the turn the state holds; a request that
    # claims otherwise starts afresh.
    assert not begin(book, "x", [user("a"), assistant("x"), turn], conversation_open_s=1
                     ).params["conversation"]["resume"]
    book.end("x", "aborted", None)  # a fresh start aborted: nothing is kept
    assert book.last_request("c") is None
    book2 = ConversationBook()
    begin(book2, "p1", [user("a"), turn], prefill_until_s=2)
    book2.end("p1", "done", None)
    second = begin(book2, "p2", [user("a"), turn], prefill_until_s=4, conversation_open_s=2)
    assert second.params["conversation"] == {"id": "c", "resume": True, "covered_s": 2}
    assert second.inputs["messages"] == [turn]
    book2.end("p2", "done", None)
    answer = begin(book2, "r2", [user("a"), turn], conversation_open_s=4)
    assert answer.params["conversation"] == {"id": "c", "resume": True, "covered_s": 4}
    book2.end("r2", "done", None)
    # Answered: the state covers the turn and its answer, as after any turn.
    after = begin(book2, "r3", [user("a"), turn, assistant("y"), user("b")])
    assert after.inputs["messages"] == [user("b")] and "covered_s" not in after.params["conversation"]


def test_book_undoes_an_abandoned_open_turn_to_the_state_before_it() -> None:
    book = ConversationBook()
    begin(book, "r1", [user("a")])
    book.end("r1", "done", None)
    fragment = spoken(3)
    for rid, until, held in (("p1", 1, 0), ("p2", 2, 1)):
        begin(book, rid, [user("a"), assistant("x"), fragment], prefill_until_s=until,
              conversation_open_s=held)
        book.end(rid, "done", None)
    # The VAD dropped the fragment: the next turn claims none of it. The last piece is what the
    # stages undo (its state's base is where the fragment began), then the turn continues the
    # answered state.
    nxt = OmniRequest("r2", {"messages": [user("a"), assistant("x"), user("b")]}, {"conversation_id": "c"})
    assert book.open_to_undo(nxt) == "p2"
    book.undo_open("c")
    assert book.open_to_undo(nxt) is None
    resumed = book.begin(nxt)
    assert resumed.params["conversation"] == {"id": "c", "resume": True}
    assert resumed.inputs["messages"] == [user("b")]


def test_book_an_abandoned_first_turn_leaves_nothing_and_an_aborted_piece_drops_all() -> None:
    book = ConversationBook()
    begin(book, "p1", [spoken(2)], prefill_until_s=1)  # the conversation's first request
    book.end("p1", "done", None)
    nxt = OmniRequest("r1", {"messages": [user("b")]}, {"conversation_id": "c"})
    assert book.open_to_undo(nxt) == "p1"
    book.undo_open("c")
    assert book.begin(nxt).params["conversation"]["resume"] is False  # nothing under the fragment
    book.end("r1", "done", None)
    begin(book, "p2", [user("b"), assistant("x"), spoken(2)], prefill_until_s=1)
    assert book.end("p2", "aborted", None)  # the stages are told to drop the conversation
    assert book.last_request("c") is None


# --- ended requests withdrawn (a speculative answer the user talked over) ---------------------


def test_book_withdraws_an_ended_last_turn_back_to_the_state_before_it() -> None:
    book = ConversationBook()
    begin(book, "r1", [user("a")])
    book.end("r1", "done", None)
    begin(book, "s", [user("a"), assistant("x"), user("b so")])
    book.end("s", "done", None)
    assert book.withdraw("s") == ("c", True)
    assert book.busy_request("c") == "s"  # the next request waits for the undo's acks
    book.withdrawn("s")
    assert book.withdraw("s") == (None, False)  # once only
    nxt = begin(book, "r2", [user("a"), assistant("x"), user("b so far")])
    assert nxt.params["conversation"] == {"id": "c", "resume": True}
    assert nxt.inputs["messages"] == [user("b so far")]


def test_book_withdraws_an_answer_to_an_open_turn_back_to_the_open_turn() -> None:
    book = ConversationBook()
    begin(book, "r1", [user("a")])
    book.end("r1", "done", None)
    turn = spoken(5)
    begin(book, "p1", [user("a"), assistant("x"), turn], prefill_until_s=2)
    book.end("p1", "done", None)
    begin(book, "s", [user("a"), assistant("x"), turn], conversation_open_s=2)
    book.end("s", "done", None)
    assert book.withdraw("s") == ("c", True)
    book.withdrawn("s")
    piece = begin(book, "p2", [user("a"), assistant("x"), turn], prefill_until_s=4, conversation_open_s=2)
    assert piece.params["conversation"] == {"id": "c", "resume": True, "covered_s": 2}


def test_book_withdraws_a_first_turn_to_nothing_and_drops_only_what_a_turn_is_in() -> None:
    book = ConversationBook()
    begin(book, "s", [user("a")])
    book.end("s", "done", None)
    assert book.withdraw("s") == ("c", True)
    book.withdrawn("s")
    assert book.last_request("c") is None
    assert not begin(book, "r1", [user("a")]).params["conversation"]["resume"]
    book.end("r1", "done", None)
    # A later turn was built on it: the caller drops the conversation's state.
    begin(book, "r2", [user("a"), assistant("x"), user("b")])
    book.end("r2", "done", None)
    assert book.withdraw("r1") == ("c", False)
    # Not in the state any more (a fresh start since, or aborted back): nothing to do.
    begin(book, "r3", [user("z")])
    book.end("r3", "done", None)
    assert book.withdraw("r2") == (None, False)
    begin(book, "r4", [user("z"), assistant("y"), user("w")])
    book.end("r4", "aborted", None)
    assert book.withdraw("r4") == (None, False)
    assert book.last_request("c") == "r3"
