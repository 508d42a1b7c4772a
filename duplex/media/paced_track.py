"""The paced outbound audio track: the agent's voice, one 20 ms frame every 20 ms.

:class:`OutboundAudioTrack` is an aiortc ``MediaStreamTrack``. aiortc's sender calls ``recv()`` in
a loop; each call waits for the next 20 ms deadline on the monotonic clock and returns a 48 kHz s16
frame of 960 samples, taken from the queue, or silence when the queue is empty or paused
(DESIGN.md invariant 6: the media path never waits on a model, and the receiver never sees a gap).
The voice is mono, sent as identical stereo channels: that is the layout aiortc's Opus encoder
wants, so its resampler passes the frames through instead of remixing them at -3 dB.

The session pushes the agent's audio as items (``enqueue(item_id, samples)``; one item per
assistant response) and controls playout with ``pause`` / ``resume`` / ``flush``, all of which act
on the very next frame. The track counts, per item, the samples it actually handed to the encoder:
``sent_ms(item_id)`` is what the user can have heard, the ``audio_end_ms`` of a truncation.
``queued_seconds`` feeds the ``duplex_outbound_queue_seconds`` gauge.

State: the queue and the per-item counters belong to the one session (one call) that owns the
track. ``release(item_id)`` drops an item's counter once the session is done with it; ``stop()``
(the peer closing) drops everything.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from duplex import metrics

SAMPLE_RATE = 48000
FRAME_SAMPLES = 960  # 20 ms at 48 kHz: one Opus frame, so aiortc's encoder never re-frames
FRAME_SECONDS = FRAME_SAMPLES / SAMPLE_RATE
TIME_BASE = fractions.Fraction(1, SAMPLE_RATE)
# Behind schedule by more than this (a stalled loop, a suspended host), the track restarts its
# schedule from now instead of bursting out every missed frame: a burst longer than the remote
# jitter buffer (~80 ms in aiortc) would only be dropped there.
MAX_LAG_SECONDS = 0.2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrackEvent:
    """What the track just did: an item's first samples went out, or the queue ran dry."""

    kind: Literal["started", "drained"]
    item_id: str


class OutboundAudioTrack(MediaStreamTrack):
    """Paced 48 kHz s16 outbound audio with an item queue (see module doc).

    ``on_playout`` is called synchronously from ``recv()`` (on the event loop) when an item's first
    samples are sent and when the queue runs dry after sending audio; it must not block.
    """

    kind = "audio"

    def __init__(
        self,
        on_playout: Callable[[TrackEvent], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: the pacing clock (tests drive the track on virtual time with their own)."""
        super().__init__()
        self.on_playout = on_playout
        self._clock = clock
        self._queue: deque[tuple[str, np.ndarray]] = deque()  # (item_id, unsent samples)
        self._queued = 0  # samples in the queue
        self._sent: dict[str, int] = {}  # item_id -> samples handed to the encoder
        self._paused = False
        self._open: set[str] = set()  # items that may still get audio (enqueued, not ended)
        self._current: str | None = None  # the item whose samples went out last
        self._last_frame_at: float | None = None  # clock time the previous frame was returned
        self._start: float | None = None  # clock time of frame 0's deadline
        self._frames = 0  # frames returned so far (the pts of the next one, in frames)
        self._schedule = 0  # frames since self._start, the schedule's own count

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def queued_seconds(self) -> float:
        return self._queued / SAMPLE_RATE

    @property
    def frames_sent(self) -> int:
        return self._frames

    def enqueue(self, item_id: str, samples: np.ndarray) -> None:
        """Queue 48 kHz mono int16 samples of ``item_id`` after everything already queued."""
        if self.readyState != "live" or len(samples) == 0:
            return
        self._queue.append((item_id, np.asarray(samples, dtype=np.int16)))
        self._queued += len(samples)
        self._sent.setdefault(item_id, 0)
        self._open.add(item_id)

    def end_item(self, item_id: str) -> None:
        """No more audio will come for ``item_id``: running dry after it is not an underrun."""
        self._open.discard(item_id)

    def pause(self) -> None:
        """Send silence from the next frame on, keeping the queue (a possible barge-in)."""
        self._paused = True

    def resume(self) -> None:
        """Carry on from where ``pause`` stopped (a false interruption)."""
        self._paused = False

    def flush(self) -> float:
        """Drop every queued sample (a confirmed barge-in); returns the seconds dropped.

        The sent counters stay: ``sent_ms`` still says what the user heard.
        """
        dropped = self.queued_seconds
        self._queue.clear()
        self._queued = 0
        self._open.clear()
        return dropped

    def sent_ms(self, item_id: str) -> int:
        """Milliseconds of ``item_id`` handed to the encoder so far (0 for an unknown item)."""
        return self._sent.get(item_id, 0) * 1000 // SAMPLE_RATE

    def release(self, item_id: str) -> None:
        """Forget ``item_id``'s counter (the session has truncated or finished that item)."""
        self._sent.pop(item_id, None)
        self._open.discard(item_id)

    def stop(self) -> None:
        self.flush()
        self._sent.clear()
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
        frame = av.AudioFrame.from_ndarray(
            np.repeat(self._next_samples(), 2).reshape(1, -1), format="s16", layout="stereo"
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

    def _next_samples(self) -> np.ndarray:
        samples = np.zeros(FRAME_SAMPLES, dtype=np.int16)
        if self._paused:
            return samples
        filled = 0
        while filled < FRAME_SAMPLES and self._queue:
            item_id, chunk = self._queue[0]
            take = min(FRAME_SAMPLES - filled, len(chunk))
            samples[filled : filled + take] = chunk[:take]
            filled += take
            self._current = item_id
            if self._sent.get(item_id) == 0:
                self._emit(TrackEvent("started", item_id))
            # An item released while still queued is played but no longer counted.
            if item_id in self._sent:
                self._sent[item_id] += take
            if take == len(chunk):
                self._queue.popleft()
            else:
                self._queue[0] = (item_id, chunk[take:])
        self._queued -= filled
        if filled < FRAME_SAMPLES and self._current in self._open:
            # The item's audio ran out before the model delivered more: the listener hears a gap.
            metrics.OUTBOUND_UNDERRUNS_TOTAL.inc()
        if filled and not self._queue:
            self._emit(TrackEvent("drained", self._current))
        return samples

    def _emit(self, event: TrackEvent) -> None:
        if self.on_playout is not None:
            self.on_playout(event)
