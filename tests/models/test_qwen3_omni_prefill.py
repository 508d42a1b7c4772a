"""Prefill while the user speaks, on the tiny Qwen3-Omni preset, greedy, against transformers itself.

A turn prefilled in pieces while the user spoke (partial requests, ``prefill_until_s``), then
answered from that open state, must give the thinker tokens and every talker codebook that
``generate`` gives for a fresh request over the whole history, and its answer must prefill only
what came after the last piece. Pieces of 8 s (the audio tower's attention block) are exact by
construction; pieces of 2 s change the tower's attention span (see preprocess.py), and on this
model still give the same tokens and frames. A turn dropped after some pieces leaves no trace in
the next answer (the open turn is undone to the state before it, or to nothing); an answer begun
on an open turn and aborted leaves the open turn as it was. Through the coordinator: a request
waits for the piece in flight (or for the abort of the request before it) and continues it, an
abandoned open turn is undone before the next request, and closing frees everything (gauges back
to 0).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from harness.speech import speech
from pipeline.proto import OmniRequest
from pipeline.scheduling.conversation_book import OPEN_PARAM, PARTIAL_PARAM
from tests.models.cases import user
from tests.models.staged import Result, Staged
from tests.models.test_qwen3_omni_conversation import (
    CONFIG,
    Conversation,
    assert_all_freed,
    assert_same,
    user_turn,
)
from tests.pipeline.helpers import collect, running

RATE = 16000
LONG = ("I would like to plan a short trip to the mountains this weekend with my family and our "
        "dog, somewhere quiet near a lake")  # 9.3 s: a whole 8 s attention block and a bit


def long_turn() -> dict[str, Any]:
    return user(audio=speech(LONG), rate=RATE)


class Spoken(Conversation):
    """A conversation whose user turns may be prefilled in pieces while they are spoken."""

    def __init__(self, staged: Staged, cid: str) -> None:
        super().__init__(staged, cid)
        self.held = 0
        self.prefilled: list[int] = []  # tokens each thinker prefill ran over
        thinker = staged.runners["thinker"]
        prefill = thinker._prefill

        def recording(slot: Any) -> Any:
            self.prefilled.append(slot.state.input_ids.numel())
            return prefill(slot)

        thinker._prefill = recording
        self.talker_takes: list[tuple[int, int]] = []  # (user rows the talker reused, rows given)
        rows = staged.runners["talker"].rows
        take = rows.take

        def taking(cid: str, given: Any) -> Any:
            cache, n = take(cid, given)
            self.talker_takes.append((n, given.shape[0]))
            return cache, n

        rows.take = taking

    def close(self) -> None:
        del self.staged.runners["thinker"]._prefill, self.staged.runners["talker"].rows.take
        for stage in ("thinker", "talker"):
            self.staged.schedulers[stage].drop_conversation(self.cid, None)

    def _submit(self, messages: list[dict[str, Any]], **params: Any) -> tuple[str, Result]:
        rid = f"{self.cid}-{self._n}"
        self._n += 1
        claim = {OPEN_PARAM: self.held} if self.held else {}
        request = OmniRequest(rid, {"messages": messages}, {"conversation_id": self.cid, **claim, **params})
        undo = self.book.open_to_undo(request)
        if undo is not None:  # what the coordinator does before an abandoning request
            self.staged.schedulers["thinker"].abort_conversation(undo, self.cid, None)
            self.book.undo_open(self.cid)
        self.staged.submit(self.book.begin(request))
        return rid, self.staged.run()[rid]

    def piece(self, turn: dict[str, Any], until: int) -> None:
        """The turn's first ``until`` seconds prefilled while it is spoken (its audio goes 50 ms on)."""
        so_far = {**turn, "audio": turn["audio"][: until * RATE + 800]}
        rid, result = self._submit([*self.messages, so_far], **{PARTIAL_PARAM: until, "modalities": ["text"]})
        assert result.error is None and result.token_ids == [] and result.frames == []
        self.book.end(rid, "done", None)
        self.held = until

    def answer(self, turn: dict[str, Any]) -> Result:
        self.messages.append(turn)
        rid, result = self._submit(list(self.messages))
        self.book.end(rid, "done", None)
        self.held = 0
        return result

    def drop_turn(self) -> None:
        """The VAD dropped the turn being spoken: the next request claims none of it."""
        self.held = 0

    def in_pieces(self, turn: dict[str, Any], piece_s: int) -> tuple[Result, int]:
        """The turn answered after pieces of ``piece_s``; and the seconds they held."""
        for until in range(piece_s, len(turn["audio"]) // RATE, piece_s):
            self.piece(turn, until)
        held = self.held
        return self.answer(turn), held


@pytest.fixture(scope="module")
def staged() -> Staged:
    return Staged(CONFIG)


@pytest.mark.parametrize("piece_s", [8, 2])
def test_a_turn_answered_from_its_pieces_equals_generate(staged: Staged, reference_model, piece_s: int) -> None:
    conv = Spoken(staged, f"pieces{piece_s}")
    try:
        # A first turn answered as usual, then a long one spoken in pieces: the pieces continue
        # the state the first answer left, and the answer continues the pieces.
        first = conv.answer(user_turn(0))
        assert_same(first, conv.reference(reference_model))
        conv.answered(first.token_ids)
        turn = long_turn()
        result, held = conv.in_pieces(turn, piece_s)
        assert held == 8
        assert_same(result, conv.reference(reference_model))
        # The answer prefilled only the audio after the last piece (13 tokens a second) and the
        # turn's end, not the turn: its pieces had.
        assert conv.prefilled[-1] <= 13 * (len(turn["audio"]) / RATE - held) + 12
        assert sum(conv.prefilled[1:-1]) >= 13 * held
        # So did the talker: the first answer's user rows, then each piece's, went into its
        # cache, and each request after reused every row of the one before.
        takes = conv.talker_takes
        assert len(takes) == 2 + 8 // piece_s and takes[0][0] == 0
        assert all(n == before for (n, _), (_, before) in zip(takes[1:], takes[:-1]))
        reused, rows = takes[-1]
        assert rows - reused <= 13 * (len(turn["audio"]) / RATE - held) + 12
    finally:
        conv.close()


def test_a_dropped_turn_leaves_no_trace(staged: Staged, reference_model) -> None:
    conv = Spoken(staged, "dropped")
    try:
        # A fragment as the conversation's first audio, dropped: nothing is left of it.
        fragment = user(audio=speech("um so I was wondering about"), rate=RATE)
        conv.piece(fragment, 1)
        conv.drop_turn()
        first = conv.answer(user_turn(0))
        assert not conv.book._records[conv.cid].resumed
        assert_same(first, conv.reference(reference_model))
        conv.answered(first.token_ids)
        # A fragment after an answer, dropped after two pieces: the next turn continues the
        # answered state as if the fragment had never been.
        conv.piece(fragment, 1)
        conv.piece(fragment, 2)
        conv.drop_turn()
        second = conv.answer(user_turn(1))
        assert conv.book._records[conv.cid].resumed
        assert_same(second, conv.reference(reference_model))
    finally:
        conv.close()


def test_an_answer_aborted_on_an_open_turn_leaves_the_turn_open(staged: Staged, reference_model) -> None:
    conv = Spoken(staged, "speculated")
    try:
        turn = long_turn()
        conv.piece(turn, 2)
        conv.piece(turn, 4)
        # An answer begun at a pause (a speculative request over the turn so far), aborted once
        # it has answered a few tokens: the user went on.
        so_far = {**turn, "audio": turn["audio"][: 5 * RATE]}
        request = OmniRequest("speculated-spec", {"messages": [so_far]},
                              {"conversation_id": conv.cid, OPEN_PARAM: 4})
        staged.submit(conv.book.begin(request))
        while not staged.results["speculated-spec"].token_ids:
            assert staged.step()
        staged.abort("speculated-spec")
        conv.book.end("speculated-spec", "aborted", None)
        conv.piece(turn, 6)
        result = conv.answer(turn)
        assert_same(result, conv.reference(reference_model))
    finally:
        conv.close()


# --- through the coordinator ------------------------------------------------------------------


async def until_holds(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Yield to the loop until ``condition()`` holds; fail naming ``what`` at the deadline."""
    try:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0)
    except TimeoutError:
        raise AssertionError(f"not {what} after {timeout} s") from None


def partial(rid: str, cid: str, turn: dict[str, Any], until: int, held: int) -> OmniRequest:
    so_far = {**turn, "audio": turn["audio"][: until * RATE + 800]}
    params = {"conversation_id": cid, PARTIAL_PARAM: until, "modalities": ["text"]}
    return OmniRequest(rid, {"messages": [so_far]}, {**params, **({OPEN_PARAM: held} if held else {})})


async def test_pieces_through_the_coordinator_wait_undo_and_free() -> None:
    turn = long_turn()
    async with running(CONFIG, "inproc") as coordinator:
        book = coordinator.conversations.book
        plain = await collect(coordinator, OmniRequest("plain", {"messages": [turn]}, {}), timeout=60)
        await collect(coordinator, partial("p1", "c", turn, 2, 0), timeout=60)
        # The answer is submitted while the second piece is still in flight: it waits for the
        # piece, then continues it (a request that did not would start afresh).
        piece = asyncio.create_task(collect(coordinator, partial("p2", "c", turn, 4, 2), timeout=60))
        await until_holds(lambda: book.busy_request("c") == "p2", "the second piece in flight")
        answer = await collect(coordinator, OmniRequest(
            "a1", {"messages": [turn]}, {"conversation_id": "c", OPEN_PARAM: 4}), timeout=60)
        await piece
        assert book._records["c"].resumed
        tokens = [t for c in answer.chunks for t in c.data.get("token_ids", [])]
        assert tokens == [t for c in plain.chunks for t in c.data.get("token_ids", [])]
        assert np.array_equal(answer.audio, plain.audio)
        # A fragment after the answer, then a request that claims none of it: the fragment is
        # undone before that request continues the answered state.
        history = [turn, {"role": "assistant", "text": ""}]
        await coordinator.abort("a1", keep_answer_tokens=0)  # heard nothing: the history's text
        fragment = user(audio=speech("um so I was wondering about"), rate=RATE)
        await collect(coordinator, OmniRequest("f1", {"messages": [*history, {
            **fragment, "audio": fragment["audio"][: RATE + 800]}]}, {
            "conversation_id": "c", PARTIAL_PARAM: 1, "modalities": ["text"]}), timeout=60)
        assert book._records["c"].open_s == 1
        nxt = [*history, user_turn(1)]
        again = await collect(coordinator, OmniRequest("a2", {"messages": nxt}, {"conversation_id": "c"}),
                              timeout=60)
        assert book._records["c"].resumed and book._records["c"].open_s == 0
        fresh = await collect(coordinator, OmniRequest("fresh", {"messages": nxt}, {}), timeout=60)
        assert [t for c in again.chunks for t in c.data.get("token_ids", [])] == [
            t for c in fresh.chunks for t in c.data.get("token_ids", [])]
        # A request that comes while the conversation's last request is being aborted (an answer
        # the user talked over) waits for the acknowledgement and continues the state from before
        # it, rather than starting afresh.
        await coordinator.abort("a2", keep_answer_tokens=0)
        history = [*nxt, {"role": "assistant", "text": ""}]
        talked_over = coordinator.stream(OmniRequest("a3", {"messages": [*history, user_turn(0)]},
                                                      {"conversation_id": "c"}))
        await anext(talked_over)
        aborting = asyncio.create_task(coordinator.abort("a3"))
        # Its broadcast is out, the acks not yet in.
        await until_holds(lambda: "a3" in coordinator._aborts, "the abort of a3 under way")
        await collect(coordinator, OmniRequest("a4", {"messages": [*history, user_turn(2)]},
                                               {"conversation_id": "c"}), timeout=60)
        await aborting
        await talked_over.aclose()
        assert book._records["c"].resumed and book.last_request("c") == "a4"
        await coordinator.close_conversation("c")
        await assert_all_freed(coordinator)
