"""The oracle: transformers' own ``generate`` on the same weights, inputs and output caps.

Tests and benchmarks compare the staged pipeline with it (DESIGN.md invariant 8). Caps are the
pipeline's: the thinker's token cap, and the talker's frame cap that depends on the answer's length
(so the thinker runs first on its own to learn that length). The codec frames are taken where
``generate`` hands them to code2wav, so they are exactly what the reference voices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import Qwen3OmniMoeForConditionalGeneration

from pipeline.models.qwen3_omni.loading import Source


@dataclass
class ReferenceOutput:
    tokens: list[int]
    codes: torch.Tensor
    """[code groups, frames]"""
    waveform: np.ndarray


def load_reference(source: Source) -> Qwen3OmniMoeForConditionalGeneration:
    """The whole model from the same checkpoint, through ``from_pretrained`` of the composite class."""
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(source.path, dtype=source.dtype)
    return model.eval()


@contextmanager
def _codes_handed_to_code2wav(model: Qwen3OmniMoeForConditionalGeneration) -> Iterator[list[torch.Tensor]]:
    captured: list[torch.Tensor] = []
    original = model.code2wav.chunked_decode

    def capture(codes: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        captured.append(codes.clone())
        return original(codes, *args, **kwargs)

    model.code2wav.chunked_decode = capture
    try:
        yield captured
    finally:
        del model.code2wav.chunked_decode


@torch.inference_mode()
def reference_generate(
    model: Qwen3OmniMoeForConditionalGeneration,
    prepared: dict[str, torch.Tensor],
    thinker_cap: int,
    talker_cap: Callable[[int], int],
    voice: str = "ethan",
) -> ReferenceOutput:
    """Greedy ``generate`` of one request as the preprocessing stage prepared it.

    ``talker_cap(answer_tokens)`` is the talker's cap in ``generate``'s units (codec tokens drawn,
    the last of which is dropped when capped) for an answer of that many thinker tokens.
    """
    ids = prepared["input_ids"][None]
    inputs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if prepared.get("input_features") is not None:
        inputs["input_features"] = prepared["input_features"]
        inputs["feature_attention_mask"] = prepared["feature_attention_mask"]
    eos = model.config.im_end_token_id
    text_only = model.thinker.generate(**inputs, max_new_tokens=thinker_cap, eos_token_id=eos, do_sample=False)
    answer = text_only.shape[1] - ids.shape[1]
    with _codes_handed_to_code2wav(model) as codes:
        sequences, waveform = model.generate(
            **inputs,
            thinker_max_new_tokens=thinker_cap,
            thinker_eos_token_id=eos,
            talker_max_new_tokens=talker_cap(answer),
            talker_do_sample=False,
            speaker=voice,
        )
    return ReferenceOutput(
        tokens=sequences[0, ids.shape[1]:].tolist(),
        codes=codes[0][0],
        waveform=waveform.reshape(-1).float().numpy(),
    )
