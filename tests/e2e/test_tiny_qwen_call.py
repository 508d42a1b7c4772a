"""The tiny Qwen3-Omni preset end to end: the real Qwen3-Omni classes (tiny random weights) answer a
WebRTC call with speech-level audio, the transcription stage beside them writes down what the user
said (the session asked for input transcription), the turn is prefilled in pieces while it is
spoken, and a barge-in clears every stage."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from harness.calls import (
    INTERRUPTION,
    QUESTION,
    Call,
    audible_seconds,
    eventually,
    hang_up,
    open_call,
    wait_stages_busy,
    wait_stages_idle,
)
from harness.server import ServerProcess, every_stage, run_server, write_preset
from harness.speech import speech
from harness.wer import wer

STAGES = list(every_stage("qwen3_omni_tiny"))
# Random weights rarely stop by themselves: these caps end long answers (each turn asks for its
# own length with max_output_tokens).
LONG_ANSWERS = {"thinker": {"max_new_tokens": 2000}, "talker": {"max_new_tokens": 1000}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("tiny")
    # Long answers (random weights rarely stop by themselves; the caps end them): an interruption
    # then lands while the thinker, talker and code2wav are all still at work. Each turn asks for
    # its own length with max_output_tokens.
    preset = write_preset(tmp / "preset.yaml", base="qwen3_omni_tiny", stages=LONG_ANSWERS)
    with run_server(preset, tmp=tmp) as running:
        yield running


def set_answer_tokens(call: Call, tokens: int | str) -> None:
    call.peer.send({"type": "session.update", "session": {"max_output_tokens": tokens}})


async def test_tiny_qwen_answers_and_is_interrupted(server: ServerProcess) -> None:
    call = await open_call(server)
    call.peer.send({"type": "session.update", "session": {
        "max_output_tokens": 16, "audio": {"input": {"transcription": {"model": "whisper-1"}}}}})
    await call.wait_event("session.updated")
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    heard = await call.wait_event("conversation.item.input_audio_transcription.completed")
    assert wer(QUESTION, heard["transcript"]) <= 0.3, heard
    done = await call.wait_event("response.done")
    assert done["response"]["status"] == "completed", done
    assert done["response"]["output"][0]["content"][0]["transcript"]
    await call.wait_event("output_audio_buffer.stopped")
    start = next(t for t, s, _ in call.peer.frames if np.abs(s).max() > 0.02)
    assert call.energy_between(start, start + 1.0) > 0.01  # speech-level, not 1e-7 silence
    # The question (4.7 s) was prefilled in 2 s pieces while it was spoken (prefill_piece_s).
    assert server.metric("duplex_prefill_pieces_total", {"outcome": "done"}) >= 2
    assert server.metric("duplex_prefill_pieces_total", {"outcome": "failed"}) == 0
    # The thinker keeps the conversation's state for the next turn (the preset's keep_model_state).
    await eventually(lambda: server.metric("pipeline_conversations_kept", {"stage": "thinker"}) == 1)
    assert server.metric("pipeline_conversation_state_bytes", {"stage": "thinker"}) > 0
    # Second turn, a long answer, interrupted while the agent speaks and every stage is at work.
    set_answer_tokens(call, 2000)
    await call.wait_event("session.updated", count=2)
    aborts = server.metric("pipeline_abort_clear_seconds_count")
    heard = audible_seconds(call)
    call.mic.say(speech("And what about the day after?", 48000, 0.3, 0.0))
    await call.wait_event("output_audio_buffer.started", count=2)
    await call.peer.wait_for(lambda: audible_seconds(call) >= heard + 1.1)
    await wait_stages_busy(server, ["thinker", "decode", "talker", "code2wav"])
    call.mic.say(speech(INTERRUPTION, 48000, 0.0, 0.0))
    cancelled = await call.wait_event("response.done", count=2)
    assert cancelled["response"]["status"] == "cancelled"
    await call.wait_event("conversation.item.truncated")
    assert server.metric("pipeline_abort_clear_seconds_count") >= aborts + 1
    # The agent's audio stopped: quiet while the user keeps talking.
    now = asyncio.get_running_loop().time()
    await call.peer.wait_for(lambda: any(t >= now + 1.0 for t, _, _ in call.peer.frames))
    assert audible_seconds(call, since=now + 0.2) == 0.0
    await hang_up(server, call)
    await wait_stages_idle(server, STAGES)
    # The session's end freed the conversation's kept state.
    await eventually(lambda: server.metric("pipeline_conversations_kept", {"stage": "thinker"}) == 0)
    assert server.metric("pipeline_conversation_state_bytes", {"stage": "thinker"}) == 0
