"""A WebRTC call with a camera on the tiny Qwen3-Omni preset (issue 24): a real aiortc client sends
speech and a moving test pattern; the server keeps a few pictures of it (duplex/media/video_window.py),
each user turn carries those seen while it was spoken to the vision stages (the committed item
shows them as ``input_image`` parts), the answers come, and once the call is over every stage, the
vision ones included, holds nothing. (A barge-in clearing every stage is test_tiny_qwen_call's,
whose stage list is the preset's; an abort inside the vision stages is
tests/models/test_qwen3_omni_vision_faults.py's.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.calls import (
    INTERRUPTION,
    QUESTION,
    hang_up,
    open_call,
    wait_stages_idle,
)
from harness.server import ServerProcess, run_server, write_preset
from harness.speech import speech
from harness.video import TestPattern
from tests.e2e.test_tiny_qwen_call import STAGES


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("camera")
    preset = write_preset(tmp / "preset.yaml", base="qwen3_omni_tiny",
                          session={"video": {"fps": 2, "max_side": 128, "frames_per_turn": 2}})
    with run_server(preset, tmp=tmp) as running:
        yield running


def user_items(call) -> list[dict]:
    return [e["item"] for e in call.events() if e["type"] == "conversation.item.done"
            and e["item"]["role"] == "user"]


async def test_the_camera_reaches_the_model_with_each_turn_and_nothing_is_left(
    server: ServerProcess,
) -> None:
    kept = server.metric("duplex_video_frames_total", {"outcome": "kept"})
    call = await open_call(server, video=TestPattern(320, 240))
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    first = await call.wait_event("response.done")
    assert first["response"]["status"] == "completed", first
    (asked,) = user_items(call)
    parts = [c["type"] for c in asked["content"]]
    assert parts[0] == "input_audio" and parts[1:] == ["input_image", "input_image"], parts
    assert server.metric("duplex_video_frames_total", {"outcome": "kept"}) >= kept + 2

    # A second turn shows what the camera showed meanwhile, and keeps the first turn's pictures.
    await call.wait_event("output_audio_buffer.stopped")
    await call.mic.say(speech(INTERRUPTION, 48000, 0.3, 0.0))
    second = await call.wait_event("response.done", count=2)
    assert second["response"]["status"] == "completed", second
    assert [c["type"] for c in user_items(call)[1]["content"]][1:] == ["input_image", "input_image"]
    await hang_up(server, call)
    await wait_stages_idle(server, STAGES)  # the vision stages included
