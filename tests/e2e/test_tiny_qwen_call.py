"""The default CPU preset end to end: the real Qwen3-Omni classes (tiny random weights) answer a
WebRTC call with speech-level audio, and a barge-in clears every stage."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.e2e.test_webrtc_calls import (
    INTERRUPTION,
    QUESTION,
    audible_seconds,
    hang_up,
    open_call,
    wait_stages_idle,
)
from tests.server import ServerProcess, run_server, write_preset
from tests.speech import speech

STAGES = ["preprocessing", "audio_encoder", "thinker", "decode", "talker", "code2wav"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("tiny")
    with run_server(write_preset(tmp / "preset.yaml", base="qwen3_omni_tiny"), tmp=tmp) as running:
        yield running


async def test_tiny_qwen_answers_and_is_interrupted(server: ServerProcess) -> None:
    call = await open_call(server)
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    done = await call.wait_event("response.done")
    assert done["response"]["status"] == "completed", done
    assert done["response"]["output"][0]["content"][0]["transcript"]
    await call.wait_event("output_audio_buffer.stopped")
    start = next(t for t, s, _ in call.peer.frames if np.abs(s).max() > 0.02)
    assert call.energy_between(start, start + 1.0) > 0.01  # speech-level, not 1e-7 silence
    # Second turn, interrupted while the agent speaks.
    heard = audible_seconds(call)
    call.mic.say(speech("And what about the day after?", 48000, 0.3, 0.0))
    await call.wait_event("output_audio_buffer.started", count=2)
    await call.peer.wait_for(lambda: audible_seconds(call) >= heard + 1.1)
    call.mic.say(speech(INTERRUPTION, 48000, 0.0, 0.0))
    cancelled = await call.wait_event("response.done", count=2)
    assert cancelled["response"]["status"] == "cancelled"
    await call.wait_event("conversation.item.truncated")
    await hang_up(server, call)
    await wait_stages_idle(server, STAGES)
