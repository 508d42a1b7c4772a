"""The offline ``lm`` stage keeps a conversation's KV between its turns (issue 28,
``pipeline/models/offline/lm_cache.py``): a turn prefills only what its prompt adds to the longest
prefix the kept KV shares with it, the answer is what a full prefill gives, and the KV is freed
with the conversation and kept within the stage's budget. The real SmolLM2-135M on
onnxruntime-genai."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("onnxruntime_genai")

from harness.lm_runner import answer, lm_slot
from pipeline.config import StageConfig
from pipeline.models import StageContext
from pipeline.scheduling.conversation_book import SESSION_PARAM

SYSTEM = {"role": "system", "text": "You are a helpful voice assistant. Answer in one short sentence."}
FIRST = {"role": "user", "text": "What is the capital of France?"}
SECOND = {"role": "user", "text": "And what is the capital of Japan?"}
# SmolLM2-135M's float32 keys and values (30 layers, 3 KV heads of 64), counted twice as held.
TOKEN_BYTES = 2 * 2 * 30 * 3 * 64 * 4


def language_model(**options):
    from pipeline.models.offline.lm import LanguageModel

    stage = StageConfig(name="lm", runner="lm", scheduler="ar", max_new_tokens=48, terminal=True,
                        max_batch=4, options={"max_sentences": 1, **options})
    return LanguageModel(StageContext(stage, {"lm": "packaged"}))


@pytest.fixture(scope="module")
def runner():
    return language_model()


def ask(runner, rid: str, messages: list[dict[str, str]], conversation: str | None = None):
    """The request's slot state (its prompt, what it reused) and its answer's text."""
    params = {} if conversation is None else {SESSION_PARAM: conversation}
    slot = lm_slot(runner, rid, messages, params=params)
    state = slot.state
    (_, text), = answer(runner, [slot])
    return state, text


def test_a_turn_prefills_only_what_it_adds_to_its_conversation(runner) -> None:
    first, said = ask(runner, "t1", [SYSTEM, FIRST], "c1")
    assert first.cached == 0 and "paris" in said.lower(), said
    turns = [SYSTEM, FIRST, {"role": "assistant", "text": said}, SECOND]
    second, said = ask(runner, "t2", turns, "c1")
    # The first turn's whole prompt and its answer are reused (two tokens short of what the KV
    # holds: the last sampled token had no KV yet), and the answer is right.
    assert second.cached >= len(first.prompt) + len(first.ids) - 3, (second.cached, len(first.prompt))
    assert "tokyo" in said.lower(), said
    # Another conversation with the same history keeps nothing of c1's.
    other, _ = ask(runner, "t3", turns, "c2")
    assert other.cached == 0


def test_the_kept_prefix_answers_as_a_full_prefill_does(runner) -> None:
    """The second request shares the first's system prompt and half its question, then differs:
    the KV kept for that prefix is reused, and the answer is token for token the one a request
    with no conversation gets (a prefix reused at the wrong length would change it)."""
    ask(runner, "p1", [SYSTEM, {"role": "user", "text": "What is the capital of Italy?"}], "c3")
    question = [SYSTEM, {"role": "user", "text": "What is the largest planet?"}]
    kept = lm_slot(runner, "p2", question, params={SESSION_PARAM: "c3"})
    fresh = lm_slot(runner, "p3", question)
    (kept_ids, _), = answer(runner, [kept])
    (fresh_ids, _), = answer(runner, [fresh])
    assert kept.state is None  # released
    assert kept_ids == fresh_ids and kept_ids


def test_a_dropped_conversation_frees_its_kv(runner) -> None:
    state, _ = ask(runner, "d1", [SYSTEM, FIRST], "c4")
    held = len(state.prompt) + len(state.ids) - 1  # the end token is not in the KV
    sizes = runner.cached_conversations()
    assert held - 1 <= sizes["c4"] / TOKEN_BYTES <= held + 1, sizes
    runner.drop_cached("c4")
    assert "c4" not in runner.cached_conversations()
    again, _ = ask(runner, "d2", [SYSTEM, FIRST], "c4")
    assert again.cached == 0


def test_the_kept_kv_stays_within_the_stage_budget() -> None:
    """Room for one conversation (~50 tokens each): a second one's KV evicts the first's."""
    small = language_model(conversation_state={"max_bytes": 80 * TOKEN_BYTES,
                                                "max_bytes_per_conversation": 80 * TOKEN_BYTES})
    ask(small, "b1", [SYSTEM, FIRST], "c5")
    assert set(small.cached_conversations()) == {"c5"}
    ask(small, "b2", [SYSTEM, SECOND], "c6")
    assert set(small.cached_conversations()) == {"c6"}
    # A conversation longer than a conversation's budget is not kept at all.
    tiny = language_model(conversation_state={"max_bytes": 10 * TOKEN_BYTES,
                                              "max_bytes_per_conversation": 10 * TOKEN_BYTES})
    ask(tiny, "b3", [SYSTEM, FIRST], "c7")
    assert tiny.cached_conversations() == {}


def test_a_conversation_dropped_while_it_decodes_keeps_nothing(runner) -> None:
    """The session ends while its answer is still being written: the decoder's generator, given
    back after the drop, is not kept (else every such session would leave its KV behind)."""
    slot = lm_slot(runner, "r1", [SYSTEM, {"role": "user", "text": "Tell me a long story."}],
                   cap=48, params={SESSION_PARAM: "c8"})
    runner.step([slot])  # its decoder runs
    runner.drop_cached("c8")
    decoder = slot.state.decoder
    answer(runner, [slot])
    decoder.join(timeout=10)
    assert not decoder.is_alive()
    assert "c8" not in runner.cached_conversations()
    # A later conversation is kept as before.
    ask(runner, "r2", [SYSTEM, FIRST], "c9")
    assert "c9" in runner.cached_conversations()


def test_without_onnxruntime_genai_the_stage_names_what_to_install(monkeypatch) -> None:
    from pipeline.models.offline.sources import MissingModelPackage

    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # as if not installed
    with pytest.raises(MissingModelPackage, match=r"onnxruntime-genai.*duplex\[offline\]"):
        language_model()
