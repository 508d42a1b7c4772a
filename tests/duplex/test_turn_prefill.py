"""A session prefills the user's turn while they speak (``prefill_piece_s``), against a scripted
pipeline (a fake of ``ModelPipeline``, named as such: the real pipeline's side is tested on the
tiny Qwen3-Omni preset in tests/models/test_qwen3_omni_prefill.py), with the real VAD.

What the session must say: each piece's request (the turn so far, the seconds to prefill, what the
kept state already holds of the turn), the answer's claim on the open turn, and none after a
turn was dropped; no piece while an answer runs; a piece in flight is aborted at the session's end.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import numpy as np

from harness.scripted_pipeline import ScriptedPipeline
from harness.speech import speech
from pipeline.proto import OmniRequest, OutputChunk
from pipeline.scheduling.conversation_book import OPEN_PARAM, PARTIAL_PARAM
from tests.duplex.test_session_scripted import RATE, Host, tone

LONG = "I would like to plan a short trip to the mountains this weekend with my family"


class Prefilling(ScriptedPipeline):
    """The scripted pipeline, where a piece of a turn ends as soon as it is submitted (unless
    ``hold_pieces``): pieces answer nothing. It notes each piece submitted while another request
    of the session still runs in it (not ended, not aborted): ``pieces_over_requests``."""

    hold_pieces = False

    def __init__(self) -> None:
        super().__init__()
        self.running: set[str] = set()
        self.pieces_over_requests: list[tuple[str, set[str]]] = []

    async def stream(self, request: OmniRequest) -> AsyncIterator[OutputChunk]:
        rid = request.request_id
        if PARTIAL_PARAM in request.params:
            others = self.running - set(self.aborted)
            if others:
                self.pieces_over_requests.append((rid, others))
            if not self.hold_pieces:
                self.requests.append(request)
                return
        self.running.add(rid)
        try:
            async for chunk in super().stream(request):
                yield chunk
        finally:
            self.running.discard(rid)

    def pieces(self) -> list[OmniRequest]:
        return [r for r in self.requests if PARTIAL_PARAM in r.params]

    def answers(self) -> list[OmniRequest]:
        return [r for r in self.requests if PARTIAL_PARAM not in r.params]


async def test_pieces_go_while_the_user_speaks_and_the_answer_continues_them() -> None:
    pipeline = Prefilling()
    host = Host(pipeline, keep_model_state=True, prefill_piece_s=1)
    turn = speech(LONG, 16000, 0.3, 0.0)
    await host.feed(turn)
    pieces = pipeline.pieces()
    seconds = len(turn) / 16000
    assert [p.params[PARTIAL_PARAM] for p in pieces] == list(range(1, len(pieces) + 1))
    assert len(pieces) >= int(seconds) - 1
    cid = pieces[0].params["conversation_id"]
    for i, piece in enumerate(pieces):
        assert piece.params["conversation_id"] == cid
        assert piece.params["modalities"] == ["text"] and "transcribe" not in piece.params
        # Each piece claims what the pieces before it hold; its audio goes 50 ms past its end.
        assert piece.params.get(OPEN_PARAM, 0) == i
        audio = piece.inputs["messages"][-1]["audio"]
        assert len(audio) >= piece.params[PARTIAL_PARAM] * 16000 + 800
    assert not pipeline.answers()
    await host.silence(30)
    await host.until(lambda: len(pipeline.answers()) == 1)
    answer = pipeline.answers()[0]
    held = pieces[-1].params[PARTIAL_PARAM]
    assert answer.params["conversation_id"] == cid and answer.params[OPEN_PARAM] == held
    # The answer's turn begins with the very samples the pieces sent.
    last = pieces[-1].inputs["messages"][-1]["audio"]
    assert np.array_equal(answer.inputs["messages"][-1]["audio"][: held * 16000], last[: held * 16000])
    count = len(pieces)
    pipeline.push(text="Sure.")
    pipeline.end()
    await host.until(lambda: host.session.response is None)
    # The next turn's first piece continues the answered state: it claims none of a turn.
    await host.feed(speech("And what should we pack?", 16000, 0.3, 0.0))
    assert len(pipeline.pieces()) > count
    nxt = pipeline.pieces()[count]
    assert nxt.params["conversation_id"] == cid and OPEN_PARAM not in nxt.params
    assert nxt.params[PARTIAL_PARAM] == 1
    assert pipeline.pieces_over_requests == []
    await host.binding.end("test over")


async def test_no_piece_while_the_answer_runs_even_as_the_user_speaks_over_it() -> None:
    """The user speaks over the answer for seconds (the barge-in is confirmed only after 3 s of
    speech, the longest a backchannel may be): no piece goes while the answer runs; the barge-in's
    turn gets its pieces once the answer is aborted."""
    pipeline = Prefilling()
    host = Host(pipeline, keep_model_state=True, prefill_piece_s=1, backchannel_max_ms=3000)
    await host.feed(speech("What is the capital of France?", 16000, 0.3, 0.0))
    await host.silence(30)
    await host.until(lambda: len(pipeline.answers()) == 1)
    answer = pipeline.answers()[0].request_id
    pipeline.push(text="Paris is the capital of France. ", audio=tone(4.0), sample_rate=RATE,
                  spoken_text="Paris is the capital of France. ")
    await host.until(lambda: host.track.queued_seconds >= 3.9)
    await host.silence(75)  # past the echo guard
    count = len(pipeline.pieces())
    over = speech(LONG, 16000, 0.0, 0.0)
    held = 5 * 16000 // 2  # 2.5 s of the user's speech while the answer runs: two pieces' worth
    await host.feed(over[:held])
    assert answer not in pipeline.aborted, "the answer was interrupted before the test's 2.5 s"
    assert pipeline.pieces_over_requests == []
    await host.feed(over[held:])
    await host.until(lambda: answer in pipeline.aborted)
    await host.silence(30)
    # The barge-in's turn was long enough for pieces: they went once the answer was over.
    assert len(pipeline.pieces()) > count
    assert pipeline.pieces_over_requests == []
    pipeline.end()
    await host.binding.end("test over")


async def test_a_dropped_turn_is_not_claimed_and_the_conversation_goes_on() -> None:
    pipeline = Prefilling()
    host = Host(pipeline, keep_model_state=True, prefill_piece_s=1)
    await host.feed(speech(LONG, 16000, 0.3, 0.0)[: 3 * 16000])
    assert len(pipeline.pieces()) == 2
    cid = pipeline.pieces()[0].params["conversation_id"]
    host.binding.receive(json.dumps({"type": "input_audio_buffer.clear"}))  # the turn is dropped
    await host.silence(10)
    before = len(pipeline.requests)
    await host.feed(speech("Hello, how are you today?", 16000, 0.3, 0.0))
    await host.silence(30)
    await host.until(lambda: len(pipeline.answers()) == 1)
    # The next turn's first request (a piece of it) claims none of the dropped turn, in the same
    # conversation (the pipeline undoes the open turn); the answer claims the new turn's pieces.
    first = pipeline.requests[before]
    assert PARTIAL_PARAM in first.params
    assert first.params["conversation_id"] == cid and OPEN_PARAM not in first.params
    answer = pipeline.answers()[0]
    assert answer.params["conversation_id"] == cid
    assert answer.params[OPEN_PARAM] == pipeline.pieces()[-1].params[PARTIAL_PARAM]
    assert pipeline.closed_conversations == []
    pipeline.end()
    await host.binding.end("test over")


async def test_the_session_end_aborts_a_piece_in_flight() -> None:
    pipeline = Prefilling()
    pipeline.hold_pieces = True
    host = Host(pipeline, keep_model_state=True, prefill_piece_s=1)
    await host.feed(speech(LONG, 16000, 0.3, 0.0)[: 3 * 16000])
    # One piece at a time: the second waits for the first, which the test never ends.
    assert len(pipeline.pieces()) == 1
    await host.binding.end("test over")
    assert pipeline.aborted == [pipeline.pieces()[0].request_id]


async def test_no_pieces_without_kept_state() -> None:
    pipeline = Prefilling()
    host = Host(pipeline, prefill_piece_s=1)  # keep_model_state off: nothing would keep them
    await host.feed(speech(LONG, 16000, 0.3, 0.0))
    assert pipeline.pieces() == []
    await host.binding.end("test over")
