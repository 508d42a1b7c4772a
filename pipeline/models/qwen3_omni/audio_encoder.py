"""Audio encoder stage: Whisper features of every clip in the batch -> thinker-width embeddings.

The clips of all requests in a batch are packed into one encoder call (the encoder attends within
each clip only, so a clip's embeddings do not depend on its neighbours) and split back per request.
Output data: ``audio_embeds`` [audio tokens, thinker hidden] on the CPU (empty without audio).
Stateless: nothing outlives ``run``.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.models import StageContext
from pipeline.models.qwen3_omni import loading
from pipeline.models.qwen3_omni.preprocess import audio_token_counts
from pipeline.scheduling.base import BatchItem


class AudioEncoder:
    """BatchRunner for the ``audio_encoder`` stage."""

    def __init__(self, ctx: StageContext) -> None:
        source = loading.resolve(ctx.model_args)
        self.device = ctx.stage.device
        self.encoder = loading.load_audio_encoder(source, self.device)
        self.hidden = self.encoder.config.output_dim

    @torch.inference_mode()
    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        clips: list[torch.Tensor] = []
        owners: list[int] = []
        for i, item in enumerate(batch):
            data = item.payload.data
            if data.get("input_features") is None:
                continue
            mask = data["feature_attention_mask"].bool()
            for row in range(mask.shape[0]):
                clips.append(data["input_features"][row][:, mask[row]])  # [mel, frames]
                owners.append(i)
        per_item: list[list[torch.Tensor]] = [[] for _ in batch]
        if clips:
            lens = torch.tensor([c.shape[1] for c in clips], device=self.device)
            packed = torch.cat(clips, dim=1).to(self.device, self.encoder.dtype)
            embeds = self.encoder(packed, feature_lens=lens).last_hidden_state
            counts = audio_token_counts(lens, self.encoder.config.n_window)
            for owner, chunk in zip(owners, embeds.split(counts)):
                per_item[owner].append(chunk)
        empty = torch.zeros(0, self.hidden, dtype=self.encoder.dtype)
        return [
            {"audio_embeds": torch.cat(chunks).cpu() if chunks else empty} for chunks in per_item
        ]
