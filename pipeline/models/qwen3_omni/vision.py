"""Image encoder stage: the thinker's vision tower over every image in the batch -> embeddings.

The preprocessing stage cuts each image into patches (``pixel_values`` [patches, channels x
temporal patch x patch x patch]) with its grid (``image_grid_thw`` [images, 3]). The images of all
requests in a batch go through the tower in one call: it attends within each image only
(``cu_seqlens`` per frame), so an image's embeddings do not depend on its neighbours.

Output data per request: ``image_embeds`` [image tokens, thinker hidden] (one row per
``<|image_pad|>``, in the prompt's order) and ``deepstack`` [deepstack layers, image tokens, thinker
hidden] (the features of the tower's middle layers that the thinker adds to its first layers' hidden
states at the image rows); both on the CPU, with zero rows when the request has no image.
Stateless: nothing outlives ``run``.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.models import StageContext
from pipeline.models.qwen3_omni import loading
from pipeline.scheduling.base import BatchItem


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
        owners = [i for i, item in enumerate(batch) if item.payload.data.get("pixel_values") is not None]
        empty = torch.zeros(0, self.hidden, dtype=self.encoder.dtype)
        out: list[dict[str, Any]] = [
            {"image_embeds": empty, "deepstack": empty.new_zeros(self.layers, 0, self.hidden)} for _ in batch
        ]
        if not owners:
            return out
        data = [batch[i].payload.data for i in owners]
        grids = torch.cat([d["image_grid_thw"] for d in data])
        pixels = torch.cat([d["pixel_values"] for d in data]).to(self.device, self.encoder.dtype)
        result = self.encoder(pixels, grid_thw=grids.to(self.device))
        tokens = [int(d["image_grid_thw"].prod(-1).sum()) // self.merge_unit for d in data]
        embeds = result.pooler_output.split(tokens)
        deep = [feature.split(tokens) for feature in result.deepstack_features]
        for k, owner in enumerate(owners):
            out[owner] = {
                "image_embeds": embeds[k].cpu(),
                "deepstack": torch.stack([layer[k] for layer in deep]).cpu(),
            }
        return out
