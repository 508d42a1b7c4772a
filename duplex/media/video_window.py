"""A call's camera or screen share, kept as the model will read it: a few small, recent pictures.

A WebRTC client may send one video track beside its audio, on presets whose model sees
(``"image"`` in its input modalities). aiortc decodes every frame in its own decoder thread (a
video codec needs each frame to decode the next); what reaches the event loop is one frame per
decoded picture. A model reads video at a few frames a second and at a few hundred pixels a side
(Qwen3-Omni: 2 fps, 28 or 32 px patches), so almost everything a camera sends is dropped here, on
the loop and without touching its pixels:

- **sampling**: a frame is kept at most every ``1 / fps`` seconds (``skipped`` otherwise);
- **size**: a frame of more than ``max_pixels`` is dropped unread (``too_large``): a 4K stream
  costs its decoding, in aiortc's thread, and nothing more;
- **one at a time**: scaling a kept frame to fit ``max_side`` and converting it to RGB (PyAV's
  swscale) runs off the loop (:func:`duplex.media.offloop.off_loop`); a frame that comes while
  the previous one is still being converted is dropped (``busy``);
- **unchanged pictures**: a picture (compared off the loop too) that differs from the last one kept by less than
  ``UNCHANGED_LEVEL`` (mean absolute difference of its pixels) is not kept again; the last one is
  marked as still seen (``unchanged``);
- **the window**: the last ``window_frames`` pictures, with when each was first and last seen.

Every frame that reaches the window is counted by outcome (``duplex_video_frames_total``).
:meth:`VideoWindow.seen_since` gives what the user's turn shows: the pictures seen since it began,
at most ``frames_per_turn`` of them evenly spread, or, when the picture has not changed, the
latest one; as :class:`TurnPictures`, with when each appeared, so that a model that reads video
reads them as one (the turn's item keeps the times as ``image_times``; the request's message
carries them). They are of one size: where the source changed size during the turn (a camera
swapped for a screen), those of the latest size.

A VideoWindow belongs to one call's session and lives as long as its video track; ``close``
drops every picture (the track ended, the session closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field

import av
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from duplex import metrics
from duplex.media.offloop import off_loop

# Below this mean absolute difference (0-255) two pictures show the same thing: sensor noise and
# compression move a still picture's pixels by 1-2 levels.
UNCHANGED_LEVEL = 4.0


class VideoInput(BaseModel):
    """How a call's video is read (a preset's ``session.video``; module doc)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fps: float = Field(default=2.0, gt=0, le=30)
    max_side: int = Field(default=448, ge=32, le=2048)  # pixels, the longer side of a kept picture
    window_frames: int = Field(default=16, ge=1, le=256)
    frames_per_turn: int = Field(default=4, ge=1, le=64)
    max_pixels: int = Field(default=1920 * 1088, ge=64 * 64)  # a larger decoded frame is dropped


@dataclass(frozen=True)
class TurnPictures:
    """What the caller's camera showed during a turn: ``images`` (uint8 RGB arrays of one size),
    oldest first, and ``times``, when each was first seen, in seconds from the first (a video's
    frame times; None where there is no picture)."""

    images: list[np.ndarray] = field(default_factory=list)
    times: list[float] | None = None

    @classmethod
    def of(cls, pictures: list[Picture]) -> TurnPictures:
        if not pictures:
            return cls()
        return cls([p.rgb for p in pictures], [p.first_seen - pictures[0].first_seen for p in pictures])


@dataclass
class Picture:
    """A kept picture: RGB, scaled; when it was first and last seen (``time.monotonic()``)."""

    rgb: np.ndarray  # uint8 [height, width, 3]
    first_seen: float
    last_seen: float


class VideoWindow:
    """See module doc."""

    def __init__(self, settings: VideoInput, log: logging.Logger | logging.LoggerAdapter) -> None:
        self.settings = settings
        self._log = log
        self._pictures: deque[Picture] = deque(maxlen=settings.window_frames)
        self._next_at = 0.0  # the earliest arrival the next picture may be sampled at
        self._converting: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def pictures(self) -> list[Picture]:
        return list(self._pictures)

    def offer(self, frame: av.VideoFrame, arrival: float) -> None:
        """A decoded frame of the track, arrived at ``arrival``: sampled, or dropped (module doc)."""
        if self._closed:
            return
        if frame.width * frame.height > self.settings.max_pixels:
            self._count("too_large")
        elif arrival < self._next_at:
            self._count("skipped")
        elif self._converting is not None:
            self._count("busy")
        else:
            self._next_at = arrival + 1 / self.settings.fps
            self._converting = asyncio.get_running_loop().create_task(self._convert(frame, arrival))

    async def _convert(self, frame: av.VideoFrame, arrival: float) -> None:
        # Only this task adds pictures, one at a time: the last one stays the last meanwhile.
        last = self._pictures[-1] if self._pictures else None
        try:
            rgb, same = await off_loop(_read, frame, self.settings.max_side,
                                       None if last is None else last.rgb)
        except (av.FFmpegError, ValueError) as exc:
            self._log.warning("a video frame could not be converted: %s", exc)
            self._count("failed")
            return
        finally:
            self._converting = None
        if self._closed:
            return
        if last is not None and same:
            last.last_seen = arrival
            self._count("unchanged")
            return
        self._pictures.append(Picture(rgb, arrival, arrival))
        self._count("kept")

    async def settled(self) -> None:
        """Return once the frame being converted, if any, is kept or dropped."""
        task = self._converting
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)

    def seen_since(self, since: float) -> TurnPictures:
        """The pictures seen at or after ``since`` (a turn's beginning) of the latest one's size,
        oldest first, at most ``frames_per_turn`` of them evenly spread, the last one always among
        them; the latest picture where none was seen since (the picture did not change, or the
        camera is slow); nothing without pictures."""
        if not self._pictures:
            return TurnPictures()
        shape = self._pictures[-1].rgb.shape
        seen = [p for p in self._pictures if p.last_seen >= since and p.rgb.shape == shape]
        if not seen:
            return TurnPictures.of([self._pictures[-1]])
        most = self.settings.frames_per_turn
        if len(seen) <= most:
            return TurnPictures.of(seen)
        picks = np.linspace(0, len(seen) - 1, most).round().astype(int)
        return TurnPictures.of([seen[i] for i in picks])

    def close(self) -> None:
        """Drop every picture; frames offered after this are ignored."""
        self._closed = True
        self._pictures.clear()
        if self._converting is not None:
            self._converting.cancel()
            self._converting = None

    def _count(self, outcome: str) -> None:
        metrics.VIDEO_FRAMES_TOTAL.labels(outcome=outcome).inc()


def _read(frame: av.VideoFrame, max_side: int, before: np.ndarray | None) -> tuple[np.ndarray, bool]:
    """The frame as a picture (:func:`scaled_rgb`), and whether it shows what ``before`` did; off
    the loop, both."""
    rgb = scaled_rgb(frame, max_side)
    return rgb, before is not None and unchanged(before, rgb)


def scaled_rgb(frame: av.VideoFrame, max_side: int) -> np.ndarray:
    """``frame`` as uint8 RGB [height, width, 3], scaled down (never up) so that its longer side
    is at most ``max_side``, its aspect kept (sides rounded to even pixels, as swscale wants)."""
    scale = min(1.0, max_side / max(frame.width, frame.height))
    width = max(2, int(frame.width * scale) // 2 * 2)
    height = max(2, int(frame.height * scale) // 2 * 2)
    return frame.to_ndarray(format="rgb24", width=width, height=height)


def unchanged(before: np.ndarray, after: np.ndarray) -> bool:
    """Whether two pictures show the same thing (module doc); pictures of other sizes differ."""
    if before.shape != after.shape:
        return False
    return float(np.abs(before.astype(np.int16) - after.astype(np.int16)).mean()) < UNCHANGED_LEVEL
