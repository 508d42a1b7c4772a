"""Synthetic video for WebRTC tests: a test pattern a client sends as its camera.

:class:`TestPattern` is an aiortc video track (paced by aiortc's ``VideoStreamTrack`` clock at
30 fps) whose frames are made with numpy and PyAV: a grey background with a bright bar that moves
across it one step per frame (``moving``), or stands still. Each track lives as long as the peer
sending it.
"""

from __future__ import annotations

import av
import numpy as np
from aiortc.mediastreams import VideoStreamTrack

BAR_PX = 16


def pattern(width: int, height: int, step: int) -> np.ndarray:
    """The test pattern's ``step``-th picture as uint8 RGB [height, width, 3]."""
    rgb = np.full((height, width, 3), 60, dtype=np.uint8)
    x = (step * BAR_PX) % max(width - BAR_PX, 1)
    rgb[:, x : x + BAR_PX] = (250, 200, 40)
    return rgb


class TestPattern(VideoStreamTrack):
    """A camera that films the test pattern (module doc); ``sent`` counts its frames."""

    __test__ = False  # not a pytest class

    def __init__(self, width: int = 320, height: int = 240, moving: bool = True) -> None:
        super().__init__()
        self.width, self.height, self.moving = width, height, moving
        self.sent = 0

    async def recv(self) -> av.VideoFrame:
        pts, time_base = await self.next_timestamp()
        rgb = pattern(self.width, self.height, self.sent if self.moving else 0)
        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
        frame.pts, frame.time_base = pts, time_base
        self.sent += 1
        return frame
