"""A tiny random-weight Qwen3-Omni checkpoint, built deterministically from a seed on first use.

It is the real architecture (``Qwen3OmniMoeForConditionalGeneration``: audio tower, MoE thinker,
MoE talker with its code predictor, code2wav) at toy sizes, saved with ``save_pretrained`` next to
a small byte-level tokenizer that carries Qwen3-Omni's special tokens and a chat template of the same
shape, and a ``WhisperFeatureExtractor`` and an image processor with the real model's settings
(images scaled to at most ``TINY_MAX_PIXELS``). The loader
(``pipeline.models.qwen3_omni.loading``) then reads it with ``from_pretrained`` exactly as it reads
the real checkpoint from the hub.

Random weights at stock initialisation make code2wav output a waveform of RMS ~1e-7 (digital
silence); the builder scales code2wav's last convolution so the output is speech-level (RMS ~0.2),
which energy-based checks (VAD, tests, black-box clients) can hear.

The checkpoint lives in ``$DUPLEX_CACHE_DIR`` (default ``~/.cache/duplex``) under a name that hashes
the seed and the spec, so a changed spec never reuses a stale build. Several stage processes may ask
for it at once: each builds into a private temporary directory and renames it into place; the
rename is atomic, the first one wins and the others discard their copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

from pipeline.models.qwen3_omni.synthetic import (
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    build_tokenizer,
    init_talker_moe,
    save_preprocessor,
)

logger = logging.getLogger(__name__)

BUILD_VERSION = 4
"""Bump when the builder changes what it writes (the cache key includes it)."""

TINY_MAX_PIXELS = 128 * 128
"""The tiny model's image processor scales images down to this (64 patches, 16 vision tokens)."""

TARGET_RMS = 0.2
"""code2wav output level the builder scales to (speech-level, well below clipping)."""

# Bytes take ids 0..255 (one token per byte), the special and role tokens follow.
TOKEN_IDS = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS + ROLE_TOKENS)}
VOCAB_SIZE = 256 + len(TOKEN_IDS)

# Talker codec vocabulary: the reference suppresses the top 1024 ids except codec EOS, so the
# vocabulary must exceed 1024; codec tokens proper are [0, CODEBOOK) and every special lies in the
# suppressed range, as in the real model (vocab 3072, codebook 2048, specials 2148..2157, 2301..).
CODEBOOK = 256
TALKER_VOCAB = CODEBOOK + 1024
CODEC = {"pad": 1100, "bos": 1101, "eos": 1102, "nothink": 1107, "think_bos": 1108, "think_eos": 1109}
SPEAKERS = {"ethan": 1200, "chelsie": 1201, "aiden": 1202}


def tiny_config_dict() -> dict[str, Any]:
    """The tiny model's config: the real architecture and rates at toy widths and depths."""
    mrope = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": [4, 2, 2],
        "interleaved": True,
        "mrope_interleaved": True,
    }
    thinker_hidden = 64
    special = {
        "audio_token_id": TOKEN_IDS["<|audio_pad|>"],
        "image_token_id": TOKEN_IDS["<|image_pad|>"],
        "video_token_id": TOKEN_IDS["<|video_pad|>"],
        "vision_start_token_id": TOKEN_IDS["<|vision_start|>"],
        "audio_start_token_id": TOKEN_IDS["<|audio_start|>"],
    }
    return {
        "thinker_config": {
            **special,
            "vision_end_token_id": TOKEN_IDS["<|vision_end|>"],
            "audio_end_token_id": TOKEN_IDS["<|audio_end|>"],
            "user_token_id": TOKEN_IDS["user"],
            "position_id_per_seconds": 13,
            "seconds_per_chunk": 2,
            "audio_config": {
                "num_mel_bins": 128,
                "encoder_layers": 2,
                "encoder_attention_heads": 2,
                "encoder_ffn_dim": 64,
                "d_model": 32,
                "output_dim": thinker_hidden,
                "downsample_hidden_size": 16,
                "n_window": 50,
                "n_window_infer": 800,
                "conv_chunksize": 500,
                "max_source_positions": 1500,
            },
            "vision_config": {
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_heads": 2,
                "out_hidden_size": thinker_hidden,
                "num_position_embeddings": 64,
                "deepstack_visual_indexes": [0],
            },
            "text_config": {
                "vocab_size": VOCAB_SIZE,
                "hidden_size": thinker_hidden,
                "intermediate_size": 64,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "moe_intermediate_size": 32,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "max_position_embeddings": 4096,
                "rope_parameters": mrope,
            },
        },
        "talker_config": {
            **special,
            "num_code_groups": 16,
            "thinker_hidden_size": thinker_hidden,
            "accept_hidden_layer": 2,
            "codec_eos_token_id": CODEC["eos"],
            "codec_nothink_id": CODEC["nothink"],
            "codec_think_bos_id": CODEC["think_bos"],
            "codec_think_eos_id": CODEC["think_eos"],
            "codec_pad_id": CODEC["pad"],
            "codec_bos_id": CODEC["bos"],
            "speaker_id": dict(SPEAKERS),
            "position_id_per_seconds": 13,
            "spatial_merge_size": 2,
            "text_config": {
                "vocab_size": TALKER_VOCAB,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 64,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "max_position_embeddings": 4096,
                "rope_parameters": mrope,
            },
            "code_predictor_config": {
                "vocab_size": CODEBOOK,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 16,
                "num_code_groups": 16,
            },
        },
        "code2wav_config": {
            "codebook_size": CODEBOOK,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "sliding_window": 72,
            "num_quantizers": 16,
            "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2],
            "decoder_dim": 64,
        },
        "im_start_token_id": TOKEN_IDS["<|im_start|>"],
        "im_end_token_id": TOKEN_IDS["<|im_end|>"],
        "tts_pad_token_id": TOKEN_IDS["<tts_pad>"],
        "tts_bos_token_id": TOKEN_IDS["<tts_text_bos>"],
        "tts_eos_token_id": TOKEN_IDS["<tts_text_eod>"],
        "system_token_id": TOKEN_IDS["system"],
        "user_token_id": TOKEN_IDS["user"],
        "assistant_token_id": TOKEN_IDS["assistant"],
    }


def _scale_code2wav(model: Qwen3OmniMoeForConditionalGeneration, seed: int) -> float:
    """Scale code2wav's last convolution so random codes decode at TARGET_RMS; returns the gain.

    The last convolution is linear and follows every non-linearity, so scaling its weight and bias
    scales the waveform before the final clamp exactly.
    """
    code2wav = model.code2wav
    cfg = code2wav.config
    gen = torch.Generator().manual_seed(seed + 1)
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, 50), generator=gen)
    last = code2wav.decoder[-1].conv
    with torch.no_grad():
        rms = code2wav(codes).float().pow(2).mean().sqrt().item()
        # Rounded, so that the thread count (which changes float sums in the last bits) cannot
        # change the checkpoint built from a seed.
        gain = float(f"{TARGET_RMS / max(rms, 1e-12):.3g}")
        last.weight.mul_(gain)
        if last.bias is not None:
            last.bias.mul_(gain)
    return gain


def spec_key(seed: int) -> str:
    spec = json.dumps({"v": BUILD_VERSION, "seed": seed, "config": tiny_config_dict()}, sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("DUPLEX_CACHE_DIR", Path.home() / ".cache" / "duplex"))


def build(out_dir: Path, seed: int) -> None:
    """Write the tiny checkpoint (model, tokenizer, feature extractor) into ``out_dir``."""
    torch.manual_seed(seed)
    config = Qwen3OmniMoeConfig(**tiny_config_dict())
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    init_talker_moe(model, config.talker_config.initializer_range)
    gain = _scale_code2wav(model, seed)
    model.save_pretrained(out_dir)
    build_tokenizer(TOKEN_IDS).save_pretrained(out_dir)
    save_preprocessor(out_dir, TINY_MAX_PIXELS)
    (out_dir / "TINY_RANDOM_WEIGHTS.json").write_text(
        json.dumps({"seed": seed, "build_version": BUILD_VERSION, "code2wav_gain": gain})
    )


def ensure_tiny_checkpoint(seed: int = 0) -> Path:
    """The tiny checkpoint's directory, built on first use (safe against concurrent builders)."""
    root = cache_root()
    final = root / f"qwen3_omni_tiny-{spec_key(seed)}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        logger.info("building tiny random-weight Qwen3-Omni checkpoint (seed %d) in %s", seed, final)
        build(tmp, seed)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not lost to a concurrent builder: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def is_tiny_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "TINY_RANDOM_WEIGHTS.json").is_file()
