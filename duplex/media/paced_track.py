"""The paced outbound audio track: the agent's voice, one 20 ms frame every 20 ms.

:class:`OutboundAudioTrack` is an aiortc ``MediaStreamTrack``. aiortc's sender calls ``recv()`` in
a loop; each call waits for the next 20 ms deadline on the monotonic clock and returns a 48 kHz s16
frame of 960 samples, taken from the queue, or silence when the queue is empty or paused
(DESIGN.md invariant 6: the media path never waits on a model, and the receiver never sees a gap).
The voice is mono, sent as identical stereo channels: that is the layout aiortc's Opus encoder
wants, so its resampler passes the frames through instead of remixing them at -3 dB.

The queue itself (items, pause / resume / flush, what was sent of each item) is a
:class:`~duplex.media.frame_queue.FrameQueue`; the track adds the 20 ms pacing and aiortc's frame
format. ``stop()`` (the peer closing) drops everything.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections.abc import Callable

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from duplex import metrics
from duplex.media.frame_queue import FrameQueue, TrackEvent

SAMPLE_RATE = 48000
FRAME_SAMPLES = 960  # 20 ms at 48 kHz: one Opus frame, so aiortc's encoder never re-frames
FRAME_SECONDS = FRAME_SAMPLES / SAMPLE_RATE
TIME_BASE = fractions.Fraction(1, SAMPLE_RATE)
# Behind schedule by more than this (a stalled loop, a suspended host), the track restarts its
# schedule from now instead of bursting out every missed frame: a burst longer than the remote
# jitter buffer (~80 ms in aiortc) would only be dropped there.
MAX_LAG_SECONDS = 0.2

logger = logging.getLogger(__name__)


class OutboundAudioTrack(FrameQueue, MediaStreamTrack):
    """Paced 48 kHz s16 outbound audio from a :class:`FrameQueue` (see module doc)."""

    kind = "audio"

    def __init__(
        self,
        on_playout: Callable[[TrackEvent], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: the pacing clock (tests drive the track on virtual time with their own)."""
        MediaStreamTrack.__init__(self)
        FrameQueue.__init__(self, SAMPLE_RATE, FRAME_SAMPLES, on_playout)
        self._clock = clock
        self._last_frame_at: float | None = None  # clock time the previous frame was returned
        self._start: float | None = None  # clock time of frame 0's deadline
        self._frames = 0  # frames returned so far (the pts of the next one, in frames)
        self._schedule = 0  # frames since self._start, the schedule's own count

    @property
    def frames_sent(self) -> int:
        return self._frames

    def stop(self) -> None:
        self.close()
        super().stop()

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = self._clock()
        if self._start is None or now - self._deadline() > MAX_LAG_SECONDS:
            if self._start is not None:
                logger.warning("outbound audio %.0f ms behind schedule: restarting it",
                               (now - self._deadline()) * 1000)
            self._start, self._schedule = now, 0
        wait = self._deadline() - now
        if wait > 0:
            await asyncio.sleep(wait)
        # Read the queue only now, after the wait, so that a pause or flush made while waiting
        # already applies to this frame.
        samples = self.next_frame()
        if samples is None:
            samples = np.zeros(FRAME_SAMPLES, dtype=np.int16)
        frame = av.AudioFrame.from_ndarray(
            np.repeat(samples, 2).reshape(1, -1), format="s16", layout="stereo"
        )
        frame.sample_rate = SAMPLE_RATE
        frame.time_base = TIME_BASE
        frame.pts = self._frames * FRAME_SAMPLES
        self._frames += 1
        self._schedule += 1
        returned = self._clock()
        if self._last_frame_at is not None:
            metrics.OUTBOUND_FRAME_GAP_SECONDS.observe(returned - self._last_frame_at)
        self._last_frame_at = returned
        return frame

    def _deadline(self) -> float:
        assert self._start is not None
        return self._start + self._schedule * FRAME_SECONDS
