"""Checkpoints made here rather than downloaded: their tokenizer, features and weight init.

Two kinds share these pieces:

- the tiny test checkpoint (``tiny.py``): real architecture at toy size, random weights saved;
- the full-size random checkpoint (``write_random_checkpoint``): Qwen3-Omni-30B-A3B's real config,
  tokenizer ids and feature extractor, but no weight files: the loader draws the weights on the
  device (``model_args.random_weights``). It lets a GPU with no network measure the real
  architecture's speed (``evaluation/gpu_check.sh``); what it says is noise.

The tokenizer is byte-level BPE without merges (one token per byte) plus Qwen3-Omni's special
tokens at the ids the config names, and a chat template of the real one's shape.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3OmniMoeConfig, WhisperFeatureExtractor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerTextSparseMoeBlock,
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
]
ROLE_TOKENS = ["user", "assistant", "system"]
"""Plain (non-special) added tokens, so that "<|im_start|>user\\n" is three tokens as with the real
tokenizer."""

REAL_TOKEN_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<|audio_start|>": 151669,
    "<|audio_end|>": 151670,
    "<tts_pad>": 151671,
    "<tts_text_bos>": 151672,
    "<tts_text_eod>": 151673,
    "<tts_text_bos_single>": 151674,
    "<|audio_pad|>": 151675,
    "user": 872,
    "assistant": 77091,
    "system": 8948,
}

# The same shape as Qwen3-Omni's template: one "<|im_start|>{role}\n...<|im_end|>\n" block per
# message, an audio part as "<|audio_start|><|audio_pad|><|audio_end|>" (the single pad is expanded
# to one token per audio frame by preprocessing), and "<|im_start|>assistant\n" as generation prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(token_ids: dict[str, int]) -> PreTrainedTokenizerFast:
    """Bytes at ids 0..255, the special and role tokens at ``token_ids`` (gaps are fine)."""
    mapping = _bytes_to_unicode()
    if set(mapping.values()) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("byte table differs from the ByteLevel pre-tokenizer's alphabet")
    vocab = {mapping[b]: b for b in range(256)} | token_ids
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    core.add_tokens(ROLE_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
        clean_up_tokenization_spaces=False,
    )
    got = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in token_ids}
    if got != token_ids:
        raise RuntimeError(f"tokenizer ids drifted: {got}")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_feature_extractor() -> WhisperFeatureExtractor:
    """Whisper log-mel features with the real model's settings (128 bins, 16 kHz, hop 160)."""
    return WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=30,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=True,
    )


def build_image_processor(max_pixels: int = 28 * 28 * 1280) -> Qwen2VLImageProcessorPil:
    """Qwen3-Omni's image settings (16-pixel patches merged 2 x 2, two frames per temporal patch,
    mean and std 0.5); ``max_pixels`` bounds the resized image (the tiny model's is small)."""
    return Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": 32 * 32, "longest_edge": max_pixels},
    )


def save_preprocessor(out_dir: Path, max_pixels: int = 28 * 28 * 1280) -> None:
    """The feature extractor and the image processor in one ``preprocessor_config.json``, as the
    real checkpoint keeps them (each class reads its own keys from it)."""
    build_feature_extractor().save_pretrained(out_dir)
    path = out_dir / "preprocessor_config.json"
    audio = json.loads(path.read_text())
    build_image_processor(max_pixels).save_pretrained(out_dir)
    path.write_text(json.dumps({**audio, **json.loads(path.read_text())}, indent=2, sort_keys=True))


def init_talker_moe(module: torch.nn.Module, std: float) -> None:
    """Initialise the talker MoE routers and experts under ``module``, which transformers leaves
    untouched.

    ``_init_weights`` covers the thinker's MoE blocks but not the talker's: its experts stay
    ``torch.empty`` (whatever memory held: not reproducible, possibly NaN) and its router zeros
    (every token routed alike). A checkpoint loaded from disk overwrites both; a model built from
    a config must set them, with the same normal(0, initializer_range) as the thinker's.
    """
    with torch.no_grad():
        for block in module.modules():
            if isinstance(block, Qwen3OmniMoeTalkerTextSparseMoeBlock):
                for param in (block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight):
                    param.normal_(mean=0.0, std=std)


def full_size_config_dict() -> dict[str, Any]:
    """Qwen3-Omni-30B-A3B-Instruct's architecture (about 35B parameters) and token ids."""
    ids = REAL_TOKEN_IDS
    mrope = {
        "rope_type": "default",
        "rope_theta": 1000000,
        "mrope_section": [24, 20, 20],
        "interleaved": True,
        "mrope_interleaved": True,
    }
    media = {
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "position_id_per_seconds": 13,
        "seconds_per_chunk": 2,
    }
    return {
        "thinker_config": {
            **media,
            "vision_end_token_id": ids["<|vision_end|>"],
            "audio_end_token_id": ids["<|audio_end|>"],
            "user_token_id": ids["user"],
            "audio_config": {
                "num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20,
                "encoder_ffn_dim": 5120, "d_model": 1280, "output_dim": 2048,
                "downsample_hidden_size": 480, "n_window": 50, "n_window_infer": 800,
                "conv_chunksize": 500, "max_source_positions": 1500,
            },
            "vision_config": {
                "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2,
                "temporal_patch_size": 2, "num_position_embeddings": 2304,
                "deepstack_visual_indexes": [8, 16, 24],
            },
            "text_config": {
                "vocab_size": 152064, "hidden_size": 2048, "intermediate_size": 768,
                "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
                "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 65536,
                "rope_parameters": mrope,
            },
        },
        "talker_config": {
            **media,
            "num_code_groups": 16,
            "thinker_hidden_size": 2048,
            "accept_hidden_layer": 24,
            "codec_eos_token_id": 2150, "codec_nothink_id": 2155, "codec_think_bos_id": 2156,
            "codec_think_eos_id": 2157, "codec_pad_id": 2148, "codec_bos_id": 2149,
            "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
            "spatial_merge_size": 2,
            "text_config": {
                "vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048,
                "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 2,
                "head_dim": 128, "moe_intermediate_size": 384, "shared_expert_intermediate_size": 768,
                "num_experts": 128, "num_experts_per_tok": 6, "norm_topk_prob": True,
                "max_position_embeddings": 65536, "rope_parameters": mrope,
            },
            "code_predictor_config": {
                "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072,
                "num_hidden_layers": 5, "num_attention_heads": 16, "num_key_value_heads": 8,
                "head_dim": 128, "num_code_groups": 16,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000},
            },
        },
        "code2wav_config": {
            "codebook_size": 2048, "hidden_size": 1024, "num_hidden_layers": 8,
            "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 3072,
            "sliding_window": 72, "num_quantizers": 16, "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2], "decoder_dim": 1536,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000},
        },
        "im_start_token_id": ids["<|im_start|>"],
        "im_end_token_id": ids["<|im_end|>"],
        "tts_pad_token_id": ids["<tts_pad>"],
        "tts_bos_token_id": ids["<tts_text_bos>"],
        "tts_eos_token_id": ids["<tts_text_eod>"],
        "system_token_id": ids["system"],
        "user_token_id": ids["user"],
        "assistant_token_id": ids["assistant"],
    }


def write_random_checkpoint(
    out_dir: Path, config: dict[str, Any] | None = None, token_ids: dict[str, int] | None = None
) -> Path:
    """A checkpoint directory without weights (full size unless ``config`` / ``token_ids`` say
    otherwise): load it with ``random_weights: true``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    Qwen3OmniMoeConfig(**(config or full_size_config_dict())).save_pretrained(out_dir)
    build_tokenizer(token_ids or REAL_TOKEN_IDS).save_pretrained(out_dir)
    save_preprocessor(out_dir)
    (out_dir / "RANDOM_WEIGHTS.json").write_text(json.dumps({"weights": "drawn at load"}))
    return out_dir
