"""A real conversation over WebRTC with the default CPU preset (``offline``: Whisper tiny.en,
SmolLM2-135M, piper), judged by what is said: the user's words as the server recognised them, the
agent's answer, and the agent's audio as a listener hears it (recognised offline again). The user
speaks with piper's natural voice: Whisper tiny.en hears espeak-ng's "of France" as "and friends"."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from harness.calls import (
    Call,
    audible_seconds,
    eventually,
    hang_up,
    open_call,
    wait_metric,
    wait_stages_idle,
)
from harness.server import ServerProcess, run_server, write_preset
from harness.speech import natural_speech
from harness.wer import wer
from pipeline.models.offline.asr import Transcriber

STAGES = ["asr", "judge", "lm", "tts"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("offline")
    # Long answers (256 tokens, not 96): the barge-in below must find the story still being
    # written and spoken, however fast this machine writes it.
    preset = write_preset(tmp / "preset.yaml", base="offline", stages={"lm": {"max_new_tokens": 256}})
    with run_server(preset, tmp=tmp) as running:
        yield running


def agent_audio(call: Call, since: float) -> np.ndarray:
    """What the client received of the agent (48 kHz mono) after ``since``."""
    chunks = [s for t, s, _ in call.peer.frames if t >= since]
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


async def ask(call: Call, question: str, count: int) -> tuple[str, dict]:
    """Say ``question``; returns the server's transcript of it and the ``response.done``."""
    await call.mic.say(natural_speech(question, 48000, 0.3, 0.0))
    heard = await call.wait_event("conversation.item.input_audio_transcription.completed", count)
    done = await call.wait_event("response.done", count)
    return heard["transcript"], done


async def test_questions_get_right_spoken_answers_and_a_barge_in_stops_the_agent(
        server: ServerProcess, transcriber: Transcriber) -> None:
    call = await open_call(server)
    loop = asyncio.get_running_loop()
    usages = []
    for turn, (question, answer) in enumerate(
            [("What is the capital of France?", "paris"), ("What is the capital of Japan?", "tokyo")], 1):
        start = loop.time()
        transcript, done = await ask(call, question, turn)
        assert wer(question, transcript) <= 0.2, transcript
        assert done["response"]["status"] == "completed", done
        said = done["response"]["output"][0]["content"][0]["transcript"]
        assert answer in said.lower(), said
        usages.append(done["response"]["usage"])
        await call.wait_event("output_audio_buffer.stopped", turn)
        heard = await asyncio.to_thread(transcriber.transcribe, agent_audio(call, start), 48000)
        assert wer(said, heard) <= 0.35, (said, heard)
    # The second turn's prompt continues the first's, whose KV the language model kept: at least
    # the whole first prompt is not prefilled again.
    assert usages[1]["input_token_details"]["cached_tokens"] >= usages[0]["input_tokens"] > 0, usages
    # A long answer, interrupted soon after it starts: the language model writes it for a few
    # seconds and the synthesis follows, so the abort finds the request still in flight (the
    # abort-to-clear histogram counts only aborts of requests in flight, acknowledged by every
    # stage).
    aborts = server.metric("pipeline_abort_clear_seconds_count")
    heard_before = audible_seconds(call)
    call.mic.say(natural_speech("Please tell me a long story about a brave knight and a dragon.",
                                48000, 0.3, 0.0))
    await call.wait_event("output_audio_buffer.started", 3)
    await call.peer.wait_for(lambda: audible_seconds(call) >= heard_before + 0.3)
    call.mic.say(natural_speech("Stop, that is enough, thank you.", 48000, 0.0, 0.0))
    cancelled = await call.wait_event("response.done", 3)
    assert cancelled["response"]["status"] == "cancelled"
    truncated = await call.wait_event("conversation.item.truncated")
    assert truncated["audio_end_ms"] >= 300
    assert server.metric("pipeline_abort_clear_seconds_count") >= aborts + 1
    now = loop.time()
    await call.peer.wait_for(lambda: any(t >= now + 1.0 for t, _, _ in call.peer.frames))
    assert audible_seconds(call, since=now + 0.2) == 0.0
    # The interruption is the next turn, and it is answered; the LM's cache follows the cut
    # history (a prefix of the text, not a token-exact cut), so it is not prefilled anew.
    done = await call.wait_event("response.done", 4)
    assert done["response"]["status"] == "completed"
    usage = done["response"]["usage"]
    assert usage["input_token_details"]["cached_tokens"] >= usages[1]["input_tokens"], usage
    # The language model keeps this one conversation's KV, and frees it when the call ends.
    await eventually(lambda: server.metric("pipeline_conversations_kept", {"stage": "lm"}) == 1)
    await hang_up(server, call)
    await wait_stages_idle(server, STAGES)
    await eventually(lambda: server.metric("pipeline_conversations_kept", {"stage": "lm"}) == 0)
    assert server.metric("pipeline_conversation_state_bytes", {"stage": "lm"}) == 0


async def test_a_backchannel_over_the_agent_lets_it_go_on(server: ServerProcess) -> None:
    """"Yeah." over the answer: the agent goes quiet at once, the server recognises a backchannel,
    and the same answer goes on; nothing is cancelled and no user turn is added."""
    call = await open_call(server)
    backchannels = server.metric("duplex_backchannels_total")
    await call.mic.say(natural_speech("Please tell me a long story about a brave knight and a dragon.",
                                      48000, 0.3, 0.0))
    await call.wait_event("output_audio_buffer.started")
    await call.peer.wait_for(lambda: audible_seconds(call) >= 1.0)
    call.mic.say(natural_speech("Yeah.", 48000, 0.0, 0.0))
    await wait_metric(server, "duplex_backchannels_total", backchannels + 1)
    resumed_at = audible_seconds(call)
    await call.peer.wait_for(lambda: audible_seconds(call) >= resumed_at + 1.0)
    # The same answer went on (a long story: it is still playing): not cancelled, no new turn.
    assert "response.done" not in call.types()
    assert call.types().count("input_audio_buffer.speech_started") == 1
    assert call.types().count("input_audio_buffer.committed") == 1
    await hang_up(server, call)
    await wait_stages_idle(server, STAGES)
