"""How Qwen3-Omni reads a video: a turn's camera frames as the vision tower's temporal patches.

A video differs from as many images in two ways, both the model's own:

- **temporal patches**: the tower reads ``temporal_patch_size`` (2) consecutive frames as one patch
  (an image is one frame repeated), so a video of n frames costs the tokens of ceil(n / 2) images.
  An odd count repeats its last frame, as transformers' ``Qwen2VLVideoProcessor.patchify`` pads;
- **time**: the rope's time position of grid step k (a pair of frames) is
  ``k * second_per_grid * position_id_per_seconds`` (``get_rope_index``), where transformers'
  processor sets ``second_per_grid = temporal_patch_size / fps``. Here the rate is the frames' own:
  their mean spacing, from the ``times`` they were seen at (a camera sampled at 2 fps gives 1 s per
  grid step, 13 positions on the real model).

The thinker takes whole rope positions (its kept state carries an integer difference between a
row's position and its index), so ``second_per_grid`` is rounded to whole positions per grid step,
1/13 s on the real model; at 2, 1 and 0.5 frames a second nothing is rounded. (``get_rope_index``
computes in float32, and k/13 s is not exact in float32 for most k: at those rates its positions
are within 1e-5 of whole numbers, which ``rope.prompt_positions`` rounds.)

The video processor of transformers imports torchvision, which does not import beside the CPU
torch here; each frame is therefore scaled, rescaled and normalised by the checkpoint's image
processor (the PIL/numpy one the images take, with the same pixel bounds), and the frames' patches
are rearranged into the video processor's layout: rows (grid t, h, w, merge h, merge w), columns
(channel, temporal patch, patch h, patch w). Stateless.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class Clip:
    """A video as a request carries it: RGB frames of one size and when each was seen (seconds)."""

    frames: list[np.ndarray]
    times: list[float]

    @classmethod
    def of(cls, frames: Any, times: Any) -> Clip:
        """A message's ``images`` seen at ``image_times``, checked; ValueError."""
        frames = [np.asarray(f) for f in frames or []]
        try:
            times = [float(t) for t in times]
        except (TypeError, ValueError):
            raise ValueError("image_times must be a list of seconds") from None
        if not frames or len(frames) != len(times):
            raise ValueError("a video needs at least one frame and one time per frame")
        first = frames[0]
        for frame in frames:
            if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3 or min(frame.shape[:2]) < 1:
                raise ValueError("a frame must be a uint8 RGB array [height, width, 3]")
            if frame.shape != first.shape:
                raise ValueError("the frames of a video must all be of one size")
        if not all(np.isfinite(times)) or any(b < a for a, b in itertools.pairwise(times)):
            raise ValueError("a video's times must be finite and in order")
        return cls(frames, times)

    def second_per_grid(self, temporal_patch: int, position_id_per_seconds: float) -> float:
        """Seconds per grid step (``temporal_patch`` frames at the frames' mean spacing), rounded
        to whole rope positions (module doc); one frame: one step of the 2 fps a camera is read at."""
        spacing = (self.times[-1] - self.times[0]) / (len(self.times) - 1) if len(self.times) > 1 else 0.5
        steps = max(1, round(temporal_patch * spacing * position_id_per_seconds))
        return steps / position_id_per_seconds


def patches(processor: Any, clips: list[Clip], position_id_per_seconds: float) -> dict[str, torch.Tensor]:
    """The tower's patches of every video (``pixel_values_videos`` [patches, C * T * p * p]), each
    video's grid (``video_grid_thw`` [videos, 3]: grid steps, patch rows, patch columns) and seconds
    per grid step (``video_second_per_grid`` [videos], float32), as transformers' processor names
    them. ``processor``: the checkpoint's image processor. ValueError for frames it refuses."""
    t = processor.temporal_patch_size
    size = processor.patch_size
    pixels, grids, seconds = [], [], []
    for clip in clips:
        frames = clip.frames + [clip.frames[-1]] * (-len(clip.frames) % t)
        out = processor(images=frames, return_tensors="pt")
        per_frame = out["pixel_values"].view(len(frames), -1, 3, t, size * size)[:, :, :, 0]
        rows = per_frame.shape[1]
        grouped = per_frame.view(len(frames) // t, t, rows, 3, size * size).permute(0, 2, 3, 1, 4)
        pixels.append(grouped.reshape(len(frames) // t * rows, 3 * t * size * size))
        _, height, width = out["image_grid_thw"][0].tolist()
        grids.append([len(frames) // t, height, width])
        seconds.append(clip.second_per_grid(t, position_id_per_seconds))
    return {
        "pixel_values_videos": torch.cat(pixels),
        "video_grid_thw": torch.tensor(grids, dtype=torch.long),
        "video_second_per_grid": torch.tensor(seconds, dtype=torch.float32),
    }
