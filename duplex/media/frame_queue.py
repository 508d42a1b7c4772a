"""The agent's audio waiting to be sent, in items, cut into fixed frames as the sender asks.

A :class:`FrameQueue` is what every paced transport sends from: the WebRTC track
(``duplex.media.paced_track``, 48 kHz, 960-sample frames) and the SIP call's RTP sender (8 kHz,
160-sample frames) each pull one frame every 20 ms with ``next_frame``. The session pushes the
agent's audio as items (``enqueue(item_id, samples)``; one item per assistant response) and controls
playout with ``pause`` / ``resume`` / ``flush``, all of which act on the very next frame. The queue
counts, per item, the samples it actually handed to the sender: ``sent_ms(item_id)`` is what the
user can have heard, the ``audio_end_ms`` of a truncation.

State: the queue and the per-item counters belong to the one session (one call) that owns the
sender. ``release(item_id)`` drops an item's counter once the session is done with it; ``close()``
drops everything and refuses audio from then on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from duplex import metrics


@dataclass(frozen=True)
class TrackEvent:
    """What the track just did: an item's first samples went out, or the queue ran dry."""

    kind: Literal["started", "drained"]
    item_id: str


class FrameQueue:
    """Items of int16 mono audio at ``rate``, handed out ``frame_samples`` at a time (see module doc).

    ``on_playout`` is called synchronously from ``next_frame`` (on the event loop) when an item's
    first samples are sent and when the queue runs dry after sending audio; it must not block.
    """

    def __init__(self, rate: int, frame_samples: int,
                 on_playout: Callable[[TrackEvent], None] | None = None) -> None:
        self.rate = rate
        self.frame_samples = frame_samples
        self.on_playout = on_playout
        # Called with each frame of audio handed to the sender, as it is (a call's recording).
        self.on_frame: Callable[[np.ndarray], None] | None = None
        self._queue: deque[tuple[str, np.ndarray]] = deque()  # (item_id, unsent samples)
        self._queued = 0  # samples in the queue
        self._sent: dict[str, int] = {}  # item_id -> samples handed to the sender
        self._paused = False
        self._closed = False
        self._open: set[str] = set()  # items that may still get audio (enqueued, not ended)
        self._current: str | None = None  # the item whose samples went out last

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def queued_seconds(self) -> float:
        return self._queued / self.rate

    def enqueue(self, item_id: str, samples: np.ndarray) -> None:
        """Queue int16 samples of ``item_id`` at ``rate`` after everything already queued."""
        if self._closed or len(samples) == 0:
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
        """Milliseconds of ``item_id`` handed to the sender so far (0 for an unknown item)."""
        return self._sent.get(item_id, 0) * 1000 // self.rate

    def release(self, item_id: str) -> None:
        """Forget ``item_id``'s counter (the session has truncated or finished that item)."""
        self._sent.pop(item_id, None)
        self._open.discard(item_id)

    def close(self) -> None:
        """Drop everything; later audio is refused (the call is over)."""
        self.flush()
        self._sent.clear()
        self._closed = True
        self.on_frame = None

    def next_frame(self) -> np.ndarray | None:
        """The next ``frame_samples`` to send, zero-padded; None when paused or nothing is queued."""
        if self._paused or not self._queue:
            self._underrun(0)
            return None
        samples = np.zeros(self.frame_samples, dtype=np.int16)
        filled = 0
        while filled < self.frame_samples and self._queue:
            item_id, chunk = self._queue[0]
            take = min(self.frame_samples - filled, len(chunk))
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
        self._underrun(filled)
        if not self._queue:
            self._emit(TrackEvent("drained", self._current))
        if self.on_frame is not None:
            self.on_frame(samples)
        return samples

    def _underrun(self, filled: int) -> None:
        if not self._paused and filled < self.frame_samples and self._current in self._open:
            # The item's audio ran out before the model delivered more: the listener hears a gap.
            metrics.OUTBOUND_UNDERRUNS_TOTAL.inc()

    def _emit(self, event: TrackEvent) -> None:
        if self.on_playout is not None:
            self.on_playout(event)
