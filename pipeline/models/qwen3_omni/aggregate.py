"""``mm_aggregate``: the fan-in of preprocessing, the audio encoder and the image encoder.

The stage waits for all three branches of a request (``wait_for``; the stage itself frees a
request's partial fan-in when it is aborted or fails, whichever branch failed). ``merge_branches``
(on the stage's event loop, so it only gathers references) puts the three parts into one payload;
the runner (on the stage's worker) then checks that every placeholder has its embedding, orders
the audio and image embeddings as their placeholders appear in the prompt, and computes the
prompt's 3-D rope positions when it holds images (``rope.py``; transformers' ``get_rope_index``
with the images' grids).

Output data (to the thinker):

- ``input_ids`` (1-D long): the prompt, unchanged;
- ``mm_embeds`` [placeholders, hidden] or None: row k is the embedding of the k-th ``<|audio_pad|>``
  or ``<|image_pad|>`` of the prompt;
- with images, ``deepstack`` [layers, image placeholders, hidden] (the rows of the image
  placeholders in order) and ``positions`` [3, len(input_ids)] (long, relative to the prompt's
  first row). Without images neither is present and every row takes its index, as before.

Stateless: nothing outlives ``run``.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.models import StageContext
from pipeline.models.qwen3_omni import loading
from pipeline.models.qwen3_omni.rope import prompt_positions
from pipeline.proto import StagePayload
from pipeline.scheduling.base import BatchItem, RequestError

BRANCHES = ("preprocessing", "audio_encoder", "image_encoder")


def merge_branches(parts: dict[str, StagePayload]) -> StagePayload:
    """The three branches' data of one request as one payload (no copies, no compute)."""
    prompt, audio, image = (parts[name] for name in BRANCHES)
    return StagePayload(
        prompt.request_id,
        {
            "input_ids": prompt.data["input_ids"],
            "image_grid_thw": prompt.data.get("image_grid_thw"),
            "audio_embeds": audio.data["audio_embeds"],
            "image_embeds": image.data["image_embeds"],
            "deepstack": image.data["deepstack"],
        },
        prompt.params,
    )


class Aggregator:
    """BatchRunner for the ``mm_aggregate`` stage; one independent result per item."""

    def __init__(self, ctx: StageContext) -> None:
        config = loading.load_config(loading.resolve(ctx.model_args).path).thinker_config
        self.config = config
        self.audio_token = config.audio_token_id
        self.image_token = config.image_token_id

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        return [self._one(item.payload.request_id, item.payload.data) for item in batch]

    def _one(self, rid: str, data: dict[str, Any]) -> dict[str, Any]:
        ids: torch.Tensor = data["input_ids"]
        audio, image = data["audio_embeds"], data["image_embeds"]
        is_audio, is_image = ids == self.audio_token, ids == self.image_token
        for name, mask, rows in (("audio", is_audio, audio), ("image", is_image, image)):
            if int(mask.sum()) != rows.shape[0]:
                raise RequestError(
                    rid, f"prompt has {int(mask.sum())} {name} placeholders but {rows.shape[0]} {name} embeddings"
                )
        out: dict[str, Any] = {"input_ids": ids, "mm_embeds": None}
        if not image.shape[0]:
            out["mm_embeds"] = audio if audio.shape[0] else None
            return out
        placeholders = ids[is_audio | is_image]
        embeds = image.new_empty(placeholders.numel(), image.shape[1])
        embeds[placeholders == self.audio_token] = audio.to(image.dtype)
        embeds[placeholders == self.image_token] = image
        out["mm_embeds"] = embeds
        out["deepstack"] = data["deepstack"]
        out["positions"] = prompt_positions(ids, data["image_grid_thw"], self.config)
        return out
