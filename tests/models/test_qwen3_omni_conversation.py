"""Kept conversation state on the tiny Qwen3-Omni preset, greedy, against transformers itself.

A conversation's turn answered from the thinker's kept state (only the new user turn is
preprocessed, encoded and prefilled) must give exactly the thinker tokens and every talker codebook
that ``generate`` gives for a fresh request over the whole history, token for token: the history's
ids are the kept ones (each earlier prompt, its answer as generated, ``<|im_end|>\\n``), which is
what the chat template renders for that history. Also: after a barge-in cut, the session's history
keeps the text of exactly the answer tokens kept, and the next turn equals a fresh request over that
cut history; an abort leaves the state as before; a session's client truncation
(``conversation.item.truncate`` after the answer was done) cuts the kept state through the
coordinator so that the next turn equals ``generate`` over the truncated history; through the
coordinator, eviction and rebuild answer as keeping does, and closing frees everything (gauges
back to 0).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from duplex.media.playout import ClientPlayout
from duplex.session.client_events import ClientEvents
from duplex.session.history import History, Item, voiced_tokens
from duplex.session.session import Session
from duplex.settings import SessionDefaults
from harness.speech import speech
from pipeline.models.qwen3_omni import thinker as thinker_module
from pipeline.models.qwen3_omni.reference import ReferenceOutput, reference_generate
from pipeline.proto import OmniRequest, OutputChunk, StagePayload
from pipeline.scheduling.base import BatchItem
from pipeline.scheduling.conversation_book import ConversationBook
from tests.models.cases import talker_cap, user
from tests.models.conftest import tiny_config
from tests.models.staged import Result, Staged
from tests.pipeline.helpers import assert_no_live_state, collect, running, wait_clear

CONFIG = tiny_config()
TURNS = ["hello there how are you", "tell me about the weather", "and what about tomorrow"]


def user_turn(i: int) -> dict[str, Any]:
    if i == 2:  # a turn with text beside its audio
        return user(text="Briefly.", audio=speech(TURNS[i]), rate=16000)
    return user(audio=speech(TURNS[i]), rate=16000)


class Conversation:
    """A conversation driven through the staged runners as the coordinator drives it (the book)."""

    def __init__(self, staged: Staged, cid: str = "conv") -> None:
        self.staged, self.cid, self.book = staged, cid, ConversationBook()
        self.pre = staged.runners["preprocessing"]
        thinker = staged.runners["thinker"]
        self.im_end, self.newline = thinker.im_end, thinker.newline
        self.messages: list[dict[str, Any]] = []
        self.ids: list[int] = []
        """The history's token ids as a fresh request renders it (the reference's input)."""
        self._n = 0

    def ask(self, message: dict[str, Any]) -> tuple[str, Result]:
        rid = f"{self.cid}-{self._n}"
        self._n += 1
        self.messages.append(message)
        request = OmniRequest(rid, {"messages": list(self.messages)}, {"conversation_id": self.cid})
        request = self.book.begin(request)
        self.staged.submit(request)
        result = self.staged.run()[rid]
        self.book.end(rid, "done", None)
        return rid, result

    def prompt_ids(self) -> list[int]:
        """The fresh-request ids of the history up to and including the last user turn."""
        new = self.pre.run([BatchItem(StagePayload("x", {"messages": self.messages[-1:]}), True)])
        return self.ids + new[0]["input_ids"].tolist()

    def answered(self, tokens: list[int]) -> None:
        """The answer (as kept) joins the history."""
        self.ids = self.prompt_ids() + tokens + ([] if tokens[-1:] == [self.im_end] else [self.im_end])
        self.ids += self.newline
        self.messages.append({"role": "assistant", "text": ""})

    def reference(self, model: Any) -> ReferenceOutput:
        """``generate`` on a fresh request over the whole history (audio features of every clip)."""
        clips = [m for m in self.messages if m["role"] == "user"]
        prepared = self.pre.run([BatchItem(StagePayload("x", {"messages": clips}), True)])[0]
        prepared["input_ids"] = torch.tensor(self.prompt_ids())
        return reference_generate(model, prepared, CONFIG.stage("thinker").max_new_tokens, talker_cap(CONFIG))


def assert_same(result: Result, ref: ReferenceOutput) -> None:
    assert result.error is None
    assert result.token_ids == ref.tokens
    codes = torch.stack(result.frames, dim=-1)
    assert codes.shape == ref.codes.shape
    assert torch.equal(codes, ref.codes)


@pytest.fixture(scope="module")
def staged() -> Staged:
    return Staged(CONFIG)


def test_kept_turns_equal_fresh_requests(staged: Staged, reference_model) -> None:
    conv = Conversation(staged, "kept")
    prefilled: list[int] = []
    thinker = staged.runners["thinker"]
    prefill = thinker._prefill

    def recording(slot):  # how many tokens each prefill ran over
        prefilled.append(slot.state.input_ids.numel())
        return prefill(slot)

    thinker._prefill = recording
    talker_rows = staged.runners["talker"].rows
    take = talker_rows.take
    reused: list[tuple[int, int]] = []  # (user rows the talker reused, user rows of the request)

    def taking(cid, rows):
        cache, n = take(cid, rows)
        reused.append((n, rows.shape[0]))
        return cache, n

    talker_rows.take = taking
    try:
        for i in range(3):
            _, result = conv.ask(user_turn(i))
            assert_same(result, conv.reference(reference_model))
            conv.answered(result.token_ids)
    finally:
        del thinker._prefill, talker_rows.take
    # Turns 2 and 3 prefilled only what was new, not the history before it: the thinker, and the
    # talker, whose prompt holds the rows of every user turn (it reused those of the turns before).
    assert prefilled[1] < len(conv.ids) // 2 and prefilled[2] < len(conv.ids) // 2
    assert reused[0][0] == 0
    assert reused[1][0] == reused[0][1] and reused[2][0] == reused[1][1] and reused[2][0] < reused[2][1]
    for stage in ("thinker", "talker"):
        assert staged.schedulers[stage].conversation_sizes().keys() == {"kept"}
        staged.schedulers[stage].drop_conversation("kept", None)
        assert staged.schedulers[stage].conversation_sizes() == {}


PICK_ROWS = thinker_module.pick_rows


def printable_only(logits: torch.Tensor, samplings: Any, histories: Any) -> list[int]:
    """The thinker's pick among printable ASCII bytes only (the tiny tokenizer's ids 32..126)."""
    masked = torch.full_like(logits, float("-inf"))
    masked[:, 32:127] = logits[:, 32:127]
    return PICK_ROWS(masked, samplings, histories)


def answer_item(chunks: list[tuple[str, dict[str, Any]]]) -> Item:
    """The assistant item a session's Response makes of a request's text and audio chunks, in
    the order they came: each delta with the answer tokens the text covers so far, each audio
    chunk's end with the answer tokens voiced by then."""
    item, covered, ms = Item("answer", "assistant", speaks=True), 0, 0
    for stage, data in chunks:
        if stage == "decode":
            covered += data["text_tokens"]
            if data["text"]:
                item.deltas.append((data["text"], ms))
                item.delta_tokens.append(covered)
        elif "audio" in data:
            ms += len(data["audio"]) * 1000 // data["sample_rate"]
            item.voiced.append((ms, data["answer_tokens"]))
    item.spoken_ms = ms
    return item


def test_barge_in_cut_then_abort_then_next_turn(staged: Staged, reference_model) -> None:
    conv = Conversation(staged, "cut")
    thinker = staged.schedulers["thinker"]
    tokenizer = staged.runners["decode"].tokenizer
    chunks: list[tuple[str, dict[str, Any]]] = []
    route = staged._route

    def spy(name, out):
        if name in ("decode", "code2wav") and getattr(out, "data", None) is not None:
            chunks.append((name, out.data))
        route(name, out)

    # The random weights answer with bytes that are not UTF-8 (0xF9 first), which no text history
    # can carry; this answer is drawn among printable ASCII, whose text tokenizes back to it.
    staged._route = spy
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(thinker_module, "pick_rows", printable_only)
            rid, first = conv.ask(user_turn(0))
    finally:
        del staged._route
    # A barge-in after the request ended, in the second audio chunk: the kept state keeps the
    # answer tokens that chunk voiced, the history exactly their text.
    item = answer_item(chunks)
    heard_ms = item.voiced[0][0] + 1
    kept = voiced_tokens(item, heard_ms)
    assert kept is not None and 1 < kept < len(first.token_ids)
    History(60).truncate(item, heard_ms)
    assert item.transcript == tokenizer.decode(first.token_ids[:kept]) != first.text
    thinker.abort_conversation(rid, conv.cid, kept)
    conv.answered(first.token_ids[:kept])
    conv.messages[-1]["text"] = item.transcript
    size = thinker.conversation_sizes()[conv.cid]
    # A turn aborted mid-answer (no cut): the kept state is what it was before it.
    conv.messages.append(user_turn(1))
    request = conv.book.begin(
        OmniRequest("cut-aborted", {"messages": list(conv.messages)}, {"conversation_id": conv.cid})
    )
    staged.submit(request)
    for _ in range(4):
        staged.step()
    staged.abort("cut-aborted")
    thinker.abort_conversation("cut-aborted", conv.cid, None)
    conv.book.end("cut-aborted", "aborted", None)
    conv.messages.pop()
    assert thinker.conversation_sizes() == {conv.cid: size}
    assert thinker.live_requests() == 0
    _, second = conv.ask(user_turn(1))
    # A fresh request over the cut history (its text, not the kept tokens) is the kept state's
    # continuation, token for token, and the turn from kept state answers as ``generate`` on it.
    fresh = conv.pre.run([BatchItem(StagePayload("fresh", {"messages": conv.messages}), True)])[0]
    assert fresh["input_ids"].tolist() == conv.prompt_ids()
    assert_same(second, conv.reference(reference_model))
    thinker.drop_conversation(conv.cid, None)


class Recorded:
    """The coordinator as a session's ModelPipeline, recording each request and its thinker tokens."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self.ready, self.output_sample_rate = True, coordinator.output_sample_rate
        self.requests: list[OmniRequest] = []
        self.tokens: dict[str, list[int]] = {}

    async def stream(self, request: OmniRequest) -> AsyncIterator[OutputChunk]:
        self.requests.append(request)
        tokens = self.tokens[request.request_id] = []
        async with contextlib.aclosing(self.coordinator.stream(request)) as chunks:
            async for chunk in chunks:
                tokens += chunk.data.get("token_ids", [])
                yield chunk

    async def abort(self, request_id: str, keep_answer_tokens: int | None = None) -> None:
        await self.coordinator.abort(request_id, keep_answer_tokens)

    async def close_conversation(self, conversation_id: str) -> None:
        await self.coordinator.close_conversation(conversation_id)

    @property
    def keeps_conversations(self) -> bool:
        return self.coordinator.keeps_conversations


async def test_a_client_truncation_then_the_next_turn_equals_generate(staged: Staged, reference_model) -> None:
    """A client that plays the audio itself truncates the answer after it was done: the session
    cuts the kept state (through the coordinator) to the tokens whose text the history keeps, and
    the next turn, from kept state, is what ``generate`` answers over the truncated history."""
    class Sink:  # the session's transport: its events are not what this test is about
        kind = "websocket"

        def send_event(self, message: dict[str, Any]) -> None:
            pass

    async def answered(session: Session, turn: int) -> None:
        session.commit_user_audio(f"item_user{turn}", speech(TURNS[turn]))
        session.start_response()
        async with asyncio.timeout(60):
            while session.response is not None:
                await asyncio.sleep(0.01)

    async with running(CONFIG, "inproc") as coordinator:
        pipeline = Recorded(coordinator)
        session = Session("sess_truncated", Sink(), ClientPlayout(), pipeline,
                          SessionDefaults(keep_model_state=True), ["default"], "tiny")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(thinker_module, "pick_rows", printable_only)  # text that tokenizes back
            await answered(session, 0)
        first = pipeline.requests[0]
        answer = session.history.items[-1]
        heard_ms = answer.voiced[0][0] + 1  # in the second audio chunk
        kept = voiced_tokens(answer, heard_ms)
        assert kept is not None and 1 < kept < len(pipeline.tokens[first.request_id])
        await ClientEvents(session).handle({"type": "conversation.item.truncate", "item_id": answer.id,
                                            "content_index": 0, "audio_end_ms": heard_ms})
        tokenizer = staged.runners["decode"].tokenizer
        assert answer.transcript == tokenizer.decode(pipeline.tokens[first.request_id][:kept])
        await answered(session, 1)
        second = pipeline.requests[1]
        cid = second.params["conversation_id"]
        assert cid == first.params["conversation_id"] and coordinator.conversations.book._records[cid].resumed
        fresh = BatchItem(StagePayload("fresh", {"messages": second.inputs["messages"]}), True)
        prepared = staged.runners["preprocessing"].run([fresh])[0]
        ref = reference_generate(reference_model, prepared, CONFIG.stage("thinker").max_new_tokens,
                                 talker_cap(CONFIG))
        assert pipeline.tokens[second.request_id] == ref.tokens
        await session.close()


def test_talker_chunks_say_what_they_voiced(staged: Staged) -> None:
    audio_rid = "voiced-audio"
    seen: list[int] = []
    route = staged._route

    def spy(name, out):
        if name == "code2wav" and getattr(out, "data", None):
            seen.append(out.data["answer_tokens"])
        route(name, out)

    staged._route = spy
    try:
        staged.submit(OmniRequest(audio_rid, {"messages": [user_turn(0)]}))
        result = staged.run()[audio_rid]
    finally:
        del staged._route
    # The talker reads one text token per frame, ahead of the speech: by the last chunk it has
    # read the whole answer (the last token as its end marker).
    assert seen == sorted(seen) and seen[0] >= 1
    assert seen[-1] == len(result.token_ids)


# --- through the coordinator: eviction, rebuild, close -----------------------------------------


def gauge(name: str, stage: str) -> float:
    """A stage's gauge; one that is not exported fails (it must not read as an idle zero)."""
    value = REGISTRY.get_sample_value(name, {"stage": stage})
    assert value is not None, f"{name}{{stage={stage!r}}} is not exported"
    return value


class Talk:
    """A session's side of one conversation through the coordinator. Each answer is cut at once
    (a barge-in before any audio: the user heard nothing), so the history's assistant turns are
    empty and a rebuild from the history renders exactly the tokens that were kept."""

    def __init__(self, coordinator: Any, cid: str) -> None:
        self.coordinator, self.cid = coordinator, cid
        self.messages: list[dict[str, Any]] = []

    async def turn(self, i: int) -> tuple[list[int], np.ndarray]:
        self.messages.append(user_turn(i))
        rid = f"{self.cid}-{len(self.messages)}"
        request = OmniRequest(rid, {"messages": list(self.messages)}, {"conversation_id": self.cid})
        outcome = await collect(self.coordinator, request, timeout=60)
        await self.coordinator.abort(rid, keep_answer_tokens=0)
        self.messages.append({"role": "assistant", "text": ""})
        return [t for c in outcome.chunks for t in c.data.get("token_ids", [])], outcome.audio


@pytest.mark.parametrize("mode", ["inproc", "process"])
async def test_eviction_rebuild_and_close_through_the_coordinator(mode: str) -> None:
    # Kept state here: ~51 kB after one turn, ~107 kB after two. This budget holds a conversation
    # of two turns, but not that and another one's first turn.
    config = tiny_config(thinker={"conversation_state": {"max_bytes": 140_000}})
    async with running(config, mode) as coordinator:
        book = coordinator.conversations.book
        evicted = Talk(coordinator, "e")
        answers = [await evicted.turn(0), await evicted.turn(1)]
        stats = await coordinator.stage_stats()
        assert set(stats["thinker"].conversations) == {"e"}
        assert gauge("pipeline_conversations_kept", "thinker") == 1
        assert gauge("pipeline_conversation_state_bytes", "thinker") > 0
        assert gauge("pipeline_conversation_state_bytes", "talker") > 0  # its user rows' KV
        # Conversation b's turn pushes the total over budget: e (least recently used) is evicted.
        await Talk(coordinator, "b").turn(0)
        await coordinator.conversations.enforce_budget()
        stats = await coordinator.stage_stats()
        assert set(stats["thinker"].conversations) == {"b"}
        # e's next turn is rebuilt from its history (a full prefill).
        answers.append(await evicted.turn(2))
        assert not book._records["e"].resumed
        for cid in ("e", "b"):
            await coordinator.close_conversation(cid)
        # The same conversation kept all along: its third turn continues the kept state.
        kept = Talk(coordinator, "k")
        kept_answers = [await kept.turn(0), await kept.turn(1), await kept.turn(2)]
        assert book._records["k"].resumed
        for (tokens, audio), (tokens2, audio2) in zip(kept_answers, answers, strict=True):
            assert tokens == tokens2
            assert np.array_equal(audio, audio2)
        await coordinator.close_conversation("k")
        await assert_all_freed(coordinator)


async def assert_all_freed(coordinator: Any) -> None:
    """Every conversation closed: no stage holds a request or a conversation, and the gauges say so.
    Stages report a request's release with their next stats, after its end reached the
    coordinator: wait for that, then nothing may be held."""
    await wait_clear(coordinator)
    stats = await coordinator.stage_stats()
    assert_no_live_state(stats)
    assert all(not s.conversations for s in stats.values())
    for stage in ("thinker", "talker"):
        assert gauge("pipeline_conversations_kept", stage) == 0
        assert gauge("pipeline_conversation_state_bytes", stage) == 0
        assert gauge("pipeline_stage_live_requests", stage) == 0
