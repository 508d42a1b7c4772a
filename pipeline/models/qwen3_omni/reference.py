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


@contextmanager
def _talker_reads_audio_config(model: Qwen3OmniMoeForConditionalGeneration) -> Iterator[None]:
    """transformers 5.24's talker computes its rope positions with the thinker's ``get_rope_index``,
    which reads ``config.audio_config.n_window`` on its own config whenever a prompt holds images
    (or video) and audio; ``Qwen3OmniMoeTalkerConfig`` has no ``audio_config``, so such a ``generate`` raises
    AttributeError. The talker is lent the thinker's (the one it means: audio rows then take
    sequential positions, as in every other path)."""
    talker_config = model.talker.config
    lent = not hasattr(talker_config, "audio_config")
    if lent:
        talker_config.audio_config = model.config.thinker_config.audio_config
    try:
        yield
    finally:
        if lent:
            del talker_config.audio_config


def _inputs(prepared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = prepared["input_ids"][None]
    inputs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if prepared.get("input_features") is not None:
        inputs["input_features"] = prepared["input_features"]
        inputs["feature_attention_mask"] = prepared["feature_attention_mask"]
    if prepared.get("pixel_values") is not None:
        inputs["pixel_values"] = prepared["pixel_values"]
        inputs["image_grid_thw"] = prepared["image_grid_thw"]
    if prepared.get("pixel_values_videos") is not None:
        inputs["pixel_values_videos"] = prepared["pixel_values_videos"]
        inputs["video_grid_thw"] = prepared["video_grid_thw"]
        inputs["video_second_per_grid"] = prepared["video_second_per_grid"]
    return inputs


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
    answer = answer_length(model, prepared, thinker_cap)
    return generate_capped(model, prepared, thinker_cap, talker_cap(answer), voice)


@torch.inference_mode()
def answer_length(
    model: Qwen3OmniMoeForConditionalGeneration, prepared: dict[str, torch.Tensor], thinker_cap: int
) -> int:
    """How many tokens the greedy thinker answers with (its EOS included)."""
    inputs = _inputs(prepared)
    eos = model.config.im_end_token_id
    text = model.thinker.generate(**inputs, max_new_tokens=thinker_cap, eos_token_id=eos, do_sample=False)
    return text.shape[1] - inputs["input_ids"].shape[1]


@torch.inference_mode()
def generate_capped(
    model: Qwen3OmniMoeForConditionalGeneration,
    prepared: dict[str, torch.Tensor],
    thinker_cap: int,
    talker_max_new_tokens: int,
    voice: str = "ethan",
) -> ReferenceOutput:
    """One greedy ``generate`` call with both caps known."""
    inputs = _inputs(prepared)
    with _codes_handed_to_code2wav(model) as codes, _talker_reads_audio_config(model):
        sequences, waveform = model.generate(
            **inputs,
            thinker_max_new_tokens=thinker_cap,
            thinker_eos_token_id=model.config.im_end_token_id,
            talker_max_new_tokens=talker_max_new_tokens,
            talker_do_sample=False,
            speaker=voice,
        )
    return ReferenceOutput(
        tokens=sequences[0, inputs["input_ids"].shape[1]:].tolist(),
        codes=codes[0][0],
        waveform=waveform.reshape(-1).float().numpy(),
    )
