"""Image encoder stage: the thinker's vision tower over every image and video in the batch.

The preprocessing stage cuts each image into patches (``pixel_values`` [patches, channels x
temporal patch x patch x patch]) with its grid (``image_grid_thw`` [images, 3]), and each video
likewise (``pixel_values_videos``, ``video_grid_thw``: ``video.py``). The images and videos of all
requests in a batch go through the tower in one call: it attends within each temporal patch only
(``cu_seqlens`` per grid step), so an image's or a video's embeddings do not depend on its
neighbours, and a video is read exactly as ``get_video_features`` reads it.

Output data per request: ``image_embeds`` [image tokens, thinker hidden] (one row per
``<|image_pad|>``, in the prompt's order) and ``deepstack`` [deepstack layers, image tokens, thinker
hidden] (the features of the tower's middle layers that the thinker adds to its first layers' hidden
states at the image rows), and the same of its videos' ``<|video_pad|>`` rows (``video_embeds``,
``video_deepstack``); all on the CPU, with zero rows when the request has none.
Stateless: nothing outlives ``run``.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.models import StageContext
from pipeline.models.qwen3_omni import loading
from pipeline.scheduling.base import BatchItem

KINDS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
"""What the tower reads, per kind: (patches, grids) in the preprocessing stage's output."""


class ImageEncoder:
    """BatchRunner for the ``image_encoder`` stage."""

    def __init__(self, ctx: StageContext) -> None:
        source = loading.resolve(ctx.model_args)
        self.device = ctx.stage.device
        self.encoder = loading.load_vision_encoder(source, self.device)
        config = self.encoder.config
        self.hidden = config.out_hidden_size
        self.layers = len(config.deepstack_visual_indexes)
        self.merge_unit = config.spatial_merge_size**2

    @torch.inference_mode()
    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        empty = torch.zeros(0, self.hidden, dtype=self.encoder.dtype)
        none = {"embeds": empty, "deepstack": empty.new_zeros(self.layers, 0, self.hidden)}
        # One tower call over (request, kind) parts: each request's images, then its videos.
        parts = [(i, kind) for i, item in enumerate(batch) for kind in KINDS
                 if item.payload.data.get(KINDS[kind][0]) is not None]
        got: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        if parts:
            data = [(batch[i].payload.data, KINDS[kind]) for i, kind in parts]
            grids = torch.cat([d[grid] for d, (_, grid) in data])
            pixels = torch.cat([d[key] for d, (key, _) in data]).to(self.device, self.encoder.dtype)
            result = self.encoder(pixels, grid_thw=grids.to(self.device))
            tokens = [int(d[grid].prod(-1).sum()) // self.merge_unit for d, (_, grid) in data]
            embeds = result.pooler_output.split(tokens)
            deep = [feature.split(tokens) for feature in result.deepstack_features]
            for k, part in enumerate(parts):
                got[part] = {"embeds": embeds[k].cpu(), "deepstack": torch.stack([layer[k] for layer in deep]).cpu()}
        out = []
        for i in range(len(batch)):
            image, video = got.get((i, "image"), none), got.get((i, "video"), none)
            out.append({"image_embeds": image["embeds"], "deepstack": image["deepstack"],
                        "video_embeds": video["embeds"], "video_deepstack": video["deepstack"]})
        return out
