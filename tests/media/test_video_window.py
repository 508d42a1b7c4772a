"""A call's video, kept as the model will read it (duplex/media/video_window.py): sampled at the
preset's rate, scaled, unchanged pictures kept once, frames too large dropped unread, a turn's
pictures of one size and with when each was seen (the turn item's ``image_times``, a request's
too); and over a real aiortc call (loopback), a client's camera reaches the
window of a peer that takes video, while a peer that does not rejects it (port 0).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import av
import numpy as np
from aiortc.contrib.media import MediaPlayer

from duplex import metrics
from duplex.media.video_window import TurnPictures, VideoInput, VideoWindow
from duplex.protocol.response_create import ResponseSpec
from duplex.session.config import SessionConfig
from duplex.session.history import History, Item
from duplex.session.model_state import KeptModelState
from duplex.session.requests import RequestBuilder
from duplex.session.speculation import Speculation
from duplex.settings import SessionDefaults
from duplex.transports.webrtc.peer import CallPeer
from harness.peers import LOOPBACK, ClientPeer, Recorder
from harness.speech import speech_wav
from harness.video import TestPattern, pattern

LOG = logging.getLogger("test")


def frame(step: int, width: int = 640, height: int = 480) -> av.VideoFrame:
    return av.VideoFrame.from_ndarray(pattern(width, height, step), format="rgb24").reformat(format="yuv420p")


def counted(outcome: str) -> float:
    return metrics.VIDEO_FRAMES_TOTAL.labels(outcome=outcome)._value.get()


async def offered(window: VideoWindow, frames: list[tuple[av.VideoFrame, float]]) -> None:
    """Offer each (frame, arrival) in turn, as a track's reader does, letting conversions end."""
    for video_frame, arrival in frames:
        window.offer(video_frame, arrival)
        await window.settled()


async def test_frames_are_sampled_at_the_rate_scaled_and_kept_in_a_bounded_window() -> None:
    window = VideoWindow(VideoInput(fps=2, max_side=160, window_frames=3, frames_per_turn=2), LOG)
    skipped = counted("skipped")
    # 30 fps for 2 s, the bar moving: a picture every 0.5 s is kept, the rest skipped unread.
    await offered(window, [(frame(i), i / 30) for i in range(60)])
    assert counted("skipped") - skipped == 56
    pictures = window.pictures
    assert len(pictures) == 3  # the window's bound: the first of four is gone
    assert [round(p.first_seen, 2) for p in pictures] == [0.5, 1.0, 1.5]
    assert all(p.rgb.shape == (120, 160, 3) and p.rgb.dtype == np.uint8 for p in pictures)
    # What a picture shows survives the scaling: the bar where the pattern had it, a quarter size.
    wanted = pattern(640, 480, 45)[::4, ::4]
    assert np.abs(pictures[-1].rgb.astype(int) - wanted.astype(int)).mean() < 8

    # A turn that began at 0.9 s shows the pictures seen since, evenly spread within its bound.
    turn = window.seen_since(0.9)
    assert len(turn.images) == 2 and turn.images[0] is pictures[1].rgb and turn.images[-1] is pictures[2].rgb
    assert turn.times is not None and [round(t, 2) for t in turn.times] == [0.0, 0.5]  # a video's times
    assert len(window.seen_since(1.2).images) == 1


async def test_a_turn_shows_pictures_of_one_size_the_latest() -> None:
    """A camera swapped for a screen share during the turn: its pictures are those of the new
    size (a model reads a turn's pictures as one video, whose frames are of one size)."""
    window = VideoWindow(VideoInput(fps=2, max_side=640), LOG)
    await offered(window, [(frame(1, 320, 240), 0.0), (frame(2, 320, 240), 0.5),
                           (frame(3, 640, 360), 1.0), (frame(4, 640, 360), 1.5)])
    turn = window.seen_since(0.0)
    assert [p.shape for p in turn.images] == [(360, 640, 3)] * 2 and turn.times == [0.0, 0.5]


async def test_a_still_picture_is_kept_once_and_shown_to_a_later_turn() -> None:
    window = VideoWindow(VideoInput(fps=2), LOG)
    unchanged = counted("unchanged")
    await offered(window, [(frame(7), t) for t in (0.0, 0.5, 1.0, 1.5)])
    (picture,) = window.pictures
    assert counted("unchanged") - unchanged == 3
    assert (picture.first_seen, picture.last_seen) == (0.0, 1.5)
    # A turn that began after the last frame came (a camera that sends nothing new) sees it too.
    (shown,) = window.seen_since(5.0).images
    assert shown is picture.rgb and window.seen_since(5.0).times == [0.0]
    window.close()
    assert window.pictures == [] and window.seen_since(0.0) == TurnPictures()
    await offered(window, [(frame(8), 9.0)])
    assert window.pictures == []  # closed: nothing more is kept


async def test_a_frame_beyond_the_pixel_bound_is_dropped_unread() -> None:
    window = VideoWindow(VideoInput(max_pixels=320 * 240), LOG)
    too_large = counted("too_large")
    await offered(window, [(frame(0, 640, 480), 0.0), (frame(1, 320, 240), 1.0)])
    assert counted("too_large") - too_large == 1
    assert [p.rgb.shape for p in window.pictures] == [(240, 320, 3)]


def video_port(sdp: str) -> int:
    (line,) = [line for line in sdp.splitlines() if line.startswith("m=video")]
    return int(line.split()[1])


async def test_a_camera_reaches_the_window_of_a_call_that_takes_video() -> None:
    window = VideoWindow(VideoInput(fps=5, max_side=160), LOG)
    listener = Recorder()
    server = CallPeer("video-1", LOOPBACK, listener, window)
    camera = TestPattern(320, 240)
    client = ClientPeer(MediaPlayer(str(speech_wav("Look at this.", 48000))).audio, video=camera)
    try:
        answer = await client.connect(server)
        assert video_port(answer) != 0
        await client.wait_for(lambda: len(window.pictures) >= 3 and len(listener.audio) > 10,
                              timeout=30)
        pictures = window.pictures
        assert all(p.rgb.shape == (120, 160, 3) for p in pictures)
        # A moving picture: every kept one differs, and they came at about the preset's rate.
        gaps = np.diff([p.first_seen for p in pictures])
        assert (gaps >= 0.2 - 1e-6).all(), gaps
        assert camera.sent > len(pictures)  # the rest was skipped, not kept
        await server.close("hangup")
        assert window.pictures == []  # the call's end drops them
    finally:
        await server.close("test over")
        await client.close()


async def test_a_4k_camera_is_dropped_unread_while_the_call_goes_on() -> None:
    """A 3840x2160 track over a real aiortc call: aiortc decodes each frame in its own thread, and
    the window drops it without reading its pixels (``too_large``, counted): nothing is kept, and
    the caller's audio keeps arriving meanwhile."""
    window = VideoWindow(VideoInput(fps=5, max_side=160), LOG)  # max_pixels: 1920x1088
    listener = Recorder()
    server = CallPeer("video-4k", LOOPBACK, listener, window)
    camera = TestPattern(3840, 2160)
    client = ClientPeer(MediaPlayer(str(speech_wav("Look at this big picture.", 48000))).audio,
                        video=camera)
    too_large, kept = counted("too_large"), counted("kept")
    try:
        await client.connect(server)
        await client.wait_for(lambda: counted("too_large") - too_large >= 3, timeout=60)
        heard = len(listener.audio)
        await client.wait_for(lambda: counted("too_large") - too_large >= 5 and len(listener.audio) > heard,
                              timeout=60)
        assert window.pictures == [] and counted("kept") == kept
    finally:
        await server.close("test over")
        await client.close()


async def test_a_call_that_cannot_see_rejects_the_camera() -> None:
    """The answer keeps the camera's section with port 0 (tests/api/test_hostile_sdp.py shows the
    call going on with such an answer; aiortc itself, as a client, refuses a rejected section
    without ICE credentials, which browsers accept)."""
    server = CallPeer("video-2", LOOPBACK, Recorder())
    client = ClientPeer(MediaPlayer(str(speech_wav("Look at this.", 48000))).audio,
                        video=TestPattern(320, 240))
    try:
        assert video_port(await server.answer(await client.offer())) == 0
    finally:
        await client.close()
        await server.close("test over")


async def test_a_turn_s_pictures_reach_the_request_with_their_times() -> None:
    """A spoken turn's pictures reach the request's message with ``image_times`` (seconds from the
    first), which a model that reads video reads as one; a client's image has none; the answer
    begun at a pause carries them too, and gives them back to the turn's item when adopted."""
    window = VideoWindow(VideoInput(fps=2, max_side=160), LOG)
    await offered(window, [(frame(k), 10.0 + k / 2) for k in range(3)])
    shown = window.seen_since(10.0)
    history = History(60.0)
    history.add(Item("client", "user", text="this label", images=[pattern(64, 64, 0)]))
    history.add(Item("turn", "user", audio=np.zeros(1600, np.float32), sample_rate=16000,
                     images=shown.images, image_times=shown.times))
    builder = RequestBuilder(SessionDefaults(), history, KeptModelState(None, False), "s")
    config = SessionConfig(instructions="", voice="default")
    request = builder.request(config, ResponseSpec.of_session(config), None)
    client, turn = request.inputs["messages"]
    assert "image_times" not in client
    assert turn["image_times"] == [0.0, 0.5, 1.0]
    assert [id(p) for p in turn["images"]] == [id(p.rgb) for p in window.pictures]

    speculative = builder.speculative(config, np.zeros(1600, np.float32), shown)
    assert speculative.inputs["messages"][-1]["image_times"] == [0.0, 0.5, 1.0]
    pipeline = Silent()
    speculation = Speculation(pipeline, speculative, np.zeros(1600, np.float32), 0,  # type: ignore[arg-type]
                              lambda *heard: None, {})
    assert speculation.pictures.times == [0.0, 0.5, 1.0]
    assert [id(p) for p in speculation.pictures.images] == [id(p) for p in shown.images]
    await speculation.abort()
    assert pipeline.withdrawn == [speculative.request_id]


class Silent:
    """A pipeline fake (named as such) that answers nothing and notes what is withdrawn."""

    def __init__(self) -> None:
        self.withdrawn: list[str] = []

    async def stream(self, request: object) -> AsyncIterator[object]:
        return
        yield

    async def withdraw(self, request_id: str) -> None:
        self.withdrawn.append(request_id)
