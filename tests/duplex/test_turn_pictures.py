"""What the caller's camera showed reaches the model with their turn (issue 24), against a scripted
pipeline (a fake of ``ModelPipeline``, named as such) with the real VAD, the real paced track on
a virtual clock, the real transport binding and a real VideoWindow fed decoded frames.

A turn carries the pictures seen while it was spoken (not those from before it), it keeps them in
the history (the next request still holds them), and a turn during which the picture did not
change shows the latest one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import av
import numpy as np

from duplex.media.video_window import VideoInput, VideoWindow
from harness.scripted_pipeline import ScriptedPipeline
from harness.speech import speech
from harness.video import pattern
from tests.duplex.test_session_scripted import STEP, Host

LOG = logging.getLogger("test")


class CameraHost(Host):
    """The scripted host, its audio arriving on its own virtual clock, as the camera's frames do."""

    async def step(self, mic: np.ndarray) -> None:
        self.session.on_audio(mic, self.clock)
        self.clock += 0.02
        await self.track.recv()
        await asyncio.sleep(0)


def frame(step: int) -> av.VideoFrame:
    return av.VideoFrame.from_ndarray(pattern(320, 240, step), format="rgb24").reformat(format="yuv420p")


async def shown(host: CameraHost, window: VideoWindow, step: int) -> None:
    """The camera shows the pattern's ``step``-th picture now (the host's clock)."""
    window.offer(frame(step), host.clock)
    await window.settled()


async def turn(host: CameraHost, pipeline: ScriptedPipeline, window: VideoWindow, text: str,
               steps: list[int]) -> None:
    """The caller says ``text``, the camera showing each of ``steps`` in turn while they speak
    (speech has begun by the first); answered."""
    audio = speech(text, 16000, 0.3, 0.0)
    start = len(audio) // 3 // STEP * STEP
    await host.feed(audio[:start])
    ends = np.linspace(start, len(audio) // STEP * STEP, len(steps) + 1).astype(int) // STEP * STEP
    for step, (a, b) in zip(steps, itertools.pairwise(ends), strict=True):
        await shown(host, window, step)
        await host.feed(audio[a:b])  # longer than the sampling period: each picture is kept
    asked = len(pipeline.requests)
    await host.silence(30)
    await host.until(lambda: len(pipeline.requests) == asked + 1)
    pipeline.push(text="I see.")
    pipeline.end()
    await host.until(lambda: host.session.response is None)


async def test_a_turn_carries_the_pictures_seen_while_it_was_spoken() -> None:
    pipeline = ScriptedPipeline()
    host = CameraHost(pipeline)
    window = host.session.video = VideoWindow(VideoInput(fps=4, max_side=160, frames_per_turn=2), LOG)
    await shown(host, window, 1)  # before the turn: not part of it
    await host.silence(15)
    await turn(host, pipeline, window, "What am I holding?", [2, 3, 4])

    last = pipeline.requests[0].inputs["messages"][-1]
    assert last["role"] == "user" and last["audio"] is not None
    pictures = window.pictures
    assert len(pictures) == 4
    # The turn's three pictures, spread over frames_per_turn: its first and its last.
    assert [id(p) for p in last["images"]] == [id(pictures[1].rgb), id(pictures[3].rgb)]
    (user,) = [i for i in host.session.history.items if i.role == "user"]
    assert [id(p) for p in user.images] == [id(p) for p in last["images"]]

    # A second turn while the picture stays as it was: the latest picture, and the first turn's
    # pictures are still in the conversation.
    await host.silence(15)
    await shown(host, window, 4)
    await turn(host, pipeline, window, "And what colour is it?", [4])
    messages = pipeline.requests[1].inputs["messages"]
    users = [m for m in messages if m["role"] == "user"]
    assert [len(m.get("images") or []) for m in users] == [2, 1]
    assert users[-1]["images"][0] is window.pictures[-1].rgb
    assert np.array_equal(users[-1]["images"][0], pictures[3].rgb)
    await host.binding.end("test over")


async def test_a_call_without_a_camera_sends_no_pictures() -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline)
    await host.feed(speech("What am I holding?", 16000, 0.3, 0.0))
    await host.silence(30)
    await host.until(lambda: len(pipeline.requests) == 1)
    assert "images" not in pipeline.requests[0].inputs["messages"][-1]
    pipeline.end()
    await host.binding.end("test over")
