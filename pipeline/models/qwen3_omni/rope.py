"""Qwen3-Omni's 3-D rope positions (mrope), computed as ``generate`` computes them, per request.

The thinker and the talker rotate each row by three positions (time, height, width). Text and audio
rows take one sequential position in all three; the rows of an image take its grid's (t, h, w)
offsets from where the image starts, and what follows an image starts after the largest of them.
A video's rows do the same, its grid steps ``second_per_grid * position_id_per_seconds`` apart in
time (``video.py``). So with images or video a row's position is not its index in the sequence;
everywhere else it is.

``generate`` keeps the difference (``rope_deltas``) on the model module, shared by every request;
the stages never use it. Instead:

- ``prompt_positions``: the mrope rows of one request's own prompt, relative to its start, from
  transformers' own ``get_rope_index`` (the ``mm_aggregate`` stage calls it, with the images' and
  videos' grids and the videos' seconds per grid);
- the thinker adds where the request starts (a kept conversation's next position) and carries the
  difference between the next position and the next index (``delta``) through decode and into the
  kept state;
- ``user_positions``: the talker's prefill reads only the rows of user turns, and ``generate`` runs
  ``get_rope_index`` over that subsequence, so each run of user rows starts one past the largest
  position of the user rows before it, keeping its own relative positions (an image's offsets).

Stateless functions; nothing here outlives a call.
"""

from __future__ import annotations

import functools
import itertools
from types import SimpleNamespace
from typing import Any

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoePreTrainedModelForConditionalGeneration as _OmniPreTrained,
)


def prompt_positions(ids: torch.Tensor, image_grid_thw: torch.Tensor | None, thinker_config: Any,
                     video_grid_thw: torch.Tensor | None = None,
                     second_per_grid: torch.Tensor | None = None) -> torch.Tensor | None:
    """The mrope positions [3, len(ids)] (long) of a prompt ``ids`` (1-D) whose images have the
    grids ``image_grid_thw`` [images, 3] and whose videos the grids ``video_grid_thw`` [videos, 3]
    and ``second_per_grid`` [videos], relative to the prompt's first row; None without either
    (every row then takes its index, as the thinker does by default)."""
    if not any(g is not None and g.numel() for g in (image_grid_thw, video_grid_thw)):
        return None
    # get_rope_index needs each audio clip's mel length to count its rows; audio rows take
    # sequential positions exactly like text, so hiding their start marker lets it treat them as
    # text and count nothing (an open turn's piece has no whole clip to measure anyway).
    plain = ids.clone()
    plain[plain == thinker_config.audio_start_token_id] = thinker_config.audio_token_id
    model = SimpleNamespace(config=thinker_config, spatial_merge_size=thinker_config.vision_config.spatial_merge_size)
    model.get_llm_pos_ids_for_vision = functools.partial(_OmniPreTrained.get_llm_pos_ids_for_vision, model)
    positions, _ = _OmniPreTrained.get_rope_index(
        model, plain[None], image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
        attention_mask=torch.ones_like(plain)[None], second_per_grids=second_per_grid,
    )
    # Whole numbers, or within float32's rounding of them (video.py): rounded, not truncated.
    return positions[:, 0].round().long()


def user_positions(positions: torch.Tensor, user: torch.Tensor, after: int) -> torch.Tensor:
    """The talker's positions [3, U] of the user rows (``user`` [n] bool) among rows at thinker
    ``positions`` [3, n]: each run of consecutive user rows keeps its relative positions and starts
    at one past the largest position before it (``after``: the largest of earlier user rows, -1
    when none)."""
    rows = positions[:, user]
    out = rows.clone()
    if out.shape[1] == 0:
        return out
    index = user.nonzero()[:, 0]
    starts = torch.ones_like(index, dtype=torch.bool)
    starts[1:] = index[1:] != index[:-1] + 1
    top = after
    for a, b in itertools.pairwise([*starts.nonzero()[:, 0].tolist(), out.shape[1]]):
        run = rows[:, a:b]
        out[:, a:b] = run - run[0, 0] + top + 1  # a run opens with <|im_start|>: a text row
        top = int(out[:, a:b].max())
    return out
