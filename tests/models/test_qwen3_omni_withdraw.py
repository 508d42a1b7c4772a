"""A speculative answer withdrawn after it finished, on the tiny Qwen3-Omni preset, greedy, against
transformers itself.

Under semantic_vad an answer is begun at a pause of the user's turn; it may be all generated
before the user goes on. Withdrawn then (``Coordinator.withdraw``: the book's ``withdraw``, an
Abort of the ended request that keeps no answer in every stage, then ``withdrawn``), its turn and
answer leave the thinker's kept state: the next turn equals ``generate`` over the history without
them, and prefills only what is new since the state from before the speculation (a whole turn
after an answer; after pieces prefilled while the user spoke, the audio after the last piece).
"""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.proto import OmniRequest
from pipeline.scheduling.base import conversation_keeper
from pipeline.scheduling.conversation_book import OPEN_PARAM
from tests.models.staged import Result, Staged
from tests.models.test_qwen3_omni_conversation import CONFIG, assert_same, user_turn
from tests.models.test_qwen3_omni_prefill import RATE, Spoken, long_turn


@pytest.fixture(scope="module")
def staged() -> Staged:
    return Staged(CONFIG)


def speculate(conv: Spoken, rid: str, turn: dict[str, Any], seconds: float) -> Result:
    """An answer to the turn's first ``seconds`` (a pause), run to its end, as the session asks it."""
    so_far = {**turn, "audio": turn["audio"][: int(seconds * RATE)]}
    claim = {OPEN_PARAM: conv.held} if conv.held else {}
    request = OmniRequest(rid, {"messages": [*conv.messages, so_far]}, {"conversation_id": conv.cid, **claim})
    conv.staged.submit(conv.book.begin(request))
    result = conv.staged.run()[rid]
    assert result.error is None and result.token_ids
    conv.book.end(rid, "done", None)
    return result


def withdraw(conv: Spoken, rid: str) -> None:
    """What the coordinator does for a withdrawn request that ended (ConversationKeeping.withdraw)."""
    assert conv.book.withdraw(rid) == (conv.cid, True)
    for scheduler in conv.staged.schedulers.values():
        keeper = conversation_keeper(scheduler)
        if keeper is not None:
            keeper.abort_conversation(rid, conv.cid, None)
    conv.book.withdrawn(rid)


def new_turn_tokens(conv: Spoken) -> int:
    """Tokens of the last user turn as a fresh request renders it, and the joiner before it."""
    return len(conv.prompt_ids()) - len(conv.ids) + 3


def test_a_finished_speculation_withdrawn_after_an_answer_leaves_no_trace(staged: Staged, reference_model) -> None:
    conv = Spoken(staged, "withdrawn")
    try:
        first = conv.answer(user_turn(0))
        conv.answered(first.token_ids)
        turn = user_turn(1)
        speculate(conv, "withdrawn-spec", turn, len(turn["audio"]) / RATE / 2)
        withdraw(conv, "withdrawn-spec")
        second = conv.answer(turn)
        assert conv.book._records[conv.cid].resumed
        assert conv.prefilled[-1] <= new_turn_tokens(conv)
        assert_same(second, conv.reference(reference_model))
    finally:
        conv.close()


def test_a_finished_speculation_on_an_open_turn_withdrawn_leaves_the_turn_open(
        staged: Staged, reference_model) -> None:
    conv = Spoken(staged, "withdrawn-open")
    try:
        turn = long_turn()
        conv.piece(turn, 2)
        conv.piece(turn, 4)
        speculate(conv, "withdrawn-open-spec", turn, 5)
        withdraw(conv, "withdrawn-open-spec")
        conv.piece(turn, 6)  # continues the open turn of 4 s
        assert conv.book._records[conv.cid].resumed
        result = conv.answer(turn)
        assert conv.prefilled[-1] <= 13 * (len(turn["audio"]) / RATE - 6) + 12
        assert_same(result, conv.reference(reference_model))
    finally:
        conv.close()
