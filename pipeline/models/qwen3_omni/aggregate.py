"""``mm_aggregate``: the fan-in of preprocessing, the audio encoder and the image encoder.

The stage waits for all three branches of a request (``wait_for``; the stage itself frees a
request's partial fan-in when it is aborted or fails, whichever branch failed). ``merge_branches``
(on the stage's event loop, so it only gathers references) puts the three parts into one payload;
the runner (on the stage's worker) then checks that every placeholder has its embedding, orders
the audio, image and video embeddings as their placeholders appear in the prompt, and computes the
prompt's 3-D rope positions when it holds images or video (``rope.py``; transformers'
``get_rope_index`` with the images' and videos' grids and the videos' seconds per grid).

Output data (to the thinker):

- ``input_ids`` (1-D long): the prompt, unchanged;
- ``mm_embeds`` [placeholders, hidden] or None: row k is the embedding of the k-th ``<|audio_pad|>``,
  ``<|image_pad|>`` or ``<|video_pad|>`` of the prompt;
- with images or video, ``deepstack`` [layers, image and video placeholders, hidden] (the rows of
  those placeholders in order, as ``generate`` joins them) and ``positions`` [3, len(input_ids)]
  (long, relative to the prompt's first row). Without either neither is present and every row
  takes its index, as before.

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
            "video_grid_thw": prompt.data.get("video_grid_thw"),
            "video_second_per_grid": prompt.data.get("video_second_per_grid"),
            "audio_embeds": audio.data["audio_embeds"],
            "image_embeds": image.data["image_embeds"],
            "deepstack": image.data["deepstack"],
            "video_embeds": image.data.get("video_embeds"),
            "video_deepstack": image.data.get("video_deepstack"),
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
        self.video_token = config.video_token_id

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        return [self._one(item.payload.request_id, item.payload.data) for item in batch]

    def _one(self, rid: str, data: dict[str, Any]) -> dict[str, Any]:
        ids: torch.Tensor = data["input_ids"]
        audio, image = data["audio_embeds"], data["image_embeds"]
        video = data["video_embeds"] if data.get("video_embeds") is not None else image[:0]
        kinds = (("audio", self.audio_token, audio), ("image", self.image_token, image),
                 ("video", self.video_token, video))
        for name, token, rows in kinds:
            placed = int((ids == token).sum())
            if placed != rows.shape[0]:
                raise RequestError(rid, f"prompt has {placed} {name} placeholders but {rows.shape[0]} {name} embeddings")
        out: dict[str, Any] = {"input_ids": ids, "mm_embeds": None}
        if not image.shape[0] and not video.shape[0]:
            out["mm_embeds"] = audio if audio.shape[0] else None
            return out
        placeholders = ids[torch.isin(ids, torch.tensor([token for _, token, _ in kinds]))]
        embeds = image.new_empty(placeholders.numel(), image.shape[1])
        for _, token, rows in kinds:
            embeds[placeholders == token] = rows.to(image.dtype)
        visual = placeholders[placeholders != self.audio_token]
        deep = data["deepstack"]
        deepstack = deep.new_empty(deep.shape[0], visual.numel(), deep.shape[2])
        deepstack[:, visual == self.image_token] = deep
        if video.shape[0]:
            deepstack[:, visual == self.video_token] = data["video_deepstack"].to(deep.dtype)
        out["mm_embeds"] = embeds
        out["deepstack"] = deepstack
        out["positions"] = prompt_positions(ids, data["image_grid_thw"], self.config,
                                            data.get("video_grid_thw"), data.get("video_second_per_grid"))
        return out
