"""A WebRTC call with a camera on the tiny Qwen3-Omni preset (issue 24): a real aiortc client sends
speech and a moving test pattern; the server keeps a few pictures of it (duplex/media/video_window.py),
the user's turn carries those seen while it was spoken to the vision stages (the committed item
shows them as ``input_image`` parts, and the model reads them: its input grows by their vision
tokens), the answer comes, and a barge-in clears every stage, the vision ones included.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.calls import (
    INTERRUPTION,
    QUESTION,
    audible_seconds,
    hang_up,
    open_call,
    wait_stages_busy,
    wait_stages_idle,
)
from harness.server import ServerProcess, run_server, write_preset
from harness.speech import speech
from harness.video import TestPattern
from tests.e2e.test_tiny_qwen_call import LONG_ANSWERS, STAGES


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("camera")
    preset = write_preset(tmp / "preset.yaml", base="qwen3_omni_tiny", stages=LONG_ANSWERS,
                          session={"video": {"fps": 2, "max_side": 128, "frames_per_turn": 2}})
    with run_server(preset, tmp=tmp) as running:
        yield running


def user_items(call) -> list[dict]:
    return [e["item"] for e in call.events() if e["type"] == "conversation.item.done"
            and e["item"]["role"] == "user"]


async def test_the_camera_reaches_the_model_with_the_turn_and_a_barge_in_clears_it(
    server: ServerProcess,
) -> None:
    kept = server.metric("duplex_video_frames_total", {"outcome": "kept"})
    call = await open_call(server, video=TestPattern(320, 240))
    call.peer.send({"type": "session.update", "session": {"max_output_tokens": 2000}})
    await call.wait_event("session.updated")
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    await call.wait_event("output_audio_buffer.started")
    (asked,) = user_items(call)
    parts = [c["type"] for c in asked["content"]]
    assert parts[0] == "input_audio" and parts[1:] == ["input_image", "input_image"], parts
    assert server.metric("duplex_video_frames_total", {"outcome": "kept"}) >= kept + 2

    # Speech over the long answer: cancelled, and every stage lets the request go.
    heard = audible_seconds(call)
    await call.peer.wait_for(lambda: audible_seconds(call) >= heard + 1.1)
    await wait_stages_busy(server, ["thinker", "talker", "code2wav"])
    call.mic.say(speech(INTERRUPTION, 48000, 0.0, 0.0))
    cancelled = await call.wait_event("response.done")
    assert cancelled["response"]["status"] == "cancelled"
    # The interruption is a turn of its own, with what the camera showed meanwhile.
    await call.peer.wait_for(lambda: len(user_items(call)) == 2, 60)
    assert "input_image" in [c["type"] for c in user_items(call)[1]["content"]]
    await hang_up(server, call)
    await wait_stages_idle(server, STAGES)
