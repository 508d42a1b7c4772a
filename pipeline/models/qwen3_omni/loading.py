"""One loading path for Qwen3-Omni: a hub id or a local directory, through ``from_pretrained``.

``model_args`` (the preset's ``pipeline.model_args``) name the checkpoint and its dtype:

- ``checkpoint``: a hub id (``Qwen/Qwen3-Omni-30B-A3B-Instruct``), a local directory, or ``tiny``
  (the random-weight test checkpoint of ``tiny.py``, built into the cache on first use and then
  read from its directory like any other).
- ``dtype``: ``bfloat16`` / ``float16`` / ``float32`` (default ``bfloat16``).
- ``seed``: the tiny checkpoint's seed (default 0).
- ``attn_implementation``: optional, passed through (``sdpa`` by default).
- ``random_weights``: draw the weights on the device instead of reading them (a checkpoint
  directory from ``synthetic.write_random_checkpoint``: full-size benchmarks with nothing to
  download; the model then speaks noise).

The device comes from each stage's config. Each stage loads only its own component from the
composite checkpoint (``thinker.*``, ``thinker.audio_tower.*``, ``thinker.visual.*``, ``talker.*``,
``code2wav.*``) with a
key mapping, so a talker process never holds the 30B thinker. Loaded components are cached for
the life of the process (a second runner over the same weights, as tests build, loads nothing).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers.conversion_mapping as conversion_mapping
from transformers import (
    AutoConfig,
    AutoFeatureExtractor,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeTalkerForConditionalGeneration,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    Qwen3OmniMoeVisionEncoder,
)
from transformers.utils import CHAT_TEMPLATE_FILE, LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE, cached_file

from pipeline.models.qwen3_omni import tiny
from pipeline.models.qwen3_omni.synthetic import init_talker_moe

logger = logging.getLogger(__name__)

DEFAULT_CHECKPOINT = "Qwen/Qwen3-Omni-30B-A3B-Instruct"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# The checkpoint stores MoE experts one tensor per expert; transformers fuses them on load through
# a conversion registered for the composite model's type. Loaded on its own, the talker has no
# registered conversion (its config's model_type is empty), so register the same MoE conversion
# for its class.
conversion_mapping.register_checkpoint_conversion_mapping(
    Qwen3OmniMoeTalkerForConditionalGeneration.__name__,
    conversion_mapping.get_checkpoint_conversion_mapping("qwen2_moe"),
    overwrite=True,
)


@dataclass(frozen=True)
class Source:
    """Where the weights come from and in which dtype; hashable, so it keys the process cache."""

    path: str
    dtype: torch.dtype
    attn_implementation: str = "sdpa"
    random_weights: bool = False

    @property
    def is_tiny(self) -> bool:
        return tiny.is_tiny_checkpoint(self.path)


def resolve(model_args: Mapping[str, Any]) -> Source:
    """The preset's model arguments as a Source (builds the tiny checkpoint on first use)."""
    checkpoint = str(model_args.get("checkpoint", DEFAULT_CHECKPOINT))
    dtype_name = str(model_args.get("dtype", "bfloat16"))
    if dtype_name not in _DTYPES:
        raise ValueError(f"model_args.dtype: {dtype_name!r} is not one of {sorted(_DTYPES)}")
    if checkpoint == "tiny":
        checkpoint = str(tiny.ensure_tiny_checkpoint(int(model_args.get("seed", 0))))
    source = Source(
        path=checkpoint,
        dtype=_DTYPES[dtype_name],
        attn_implementation=str(model_args.get("attn_implementation", "sdpa")),
        random_weights=bool(model_args.get("random_weights", False)),
    )
    _announce(source)
    return source


@functools.cache
def _announce(source: Source) -> None:
    """Say once per process which weights serve; random ones loudly."""
    random = source.is_tiny or source.random_weights
    logger.log(logging.WARNING if random else logging.INFO, "serving %s", describe(source))


def describe(source: Source) -> str:
    """One line for the startup log that says plainly which weights serve."""
    if source.is_tiny:
        return f"tiny Qwen3-Omni with RANDOM weights (test checkpoint at {source.path})"
    if source.random_weights:
        return f"Qwen3-Omni architecture of {source.path} with RANDOM weights drawn at load (benchmark)"
    return f"Qwen3-Omni checkpoint {source.path} ({source.dtype})"


@functools.cache
def load_config(path: str) -> Qwen3OmniMoeConfig:
    return AutoConfig.from_pretrained(path)


@functools.cache
def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer with its chat template (the processor's when the tokenizer has
    none: the full processor cannot load here, it needs torchvision for images and video)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _processor_chat_template(path)
    return tokenizer


def _processor_chat_template(path: str) -> str:
    jinja = cached_file(path, CHAT_TEMPLATE_FILE, _raise_exceptions_for_missing_entries=False)
    if jinja is not None:
        return Path(jinja).read_text()
    legacy = cached_file(path, LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE, _raise_exceptions_for_missing_entries=False)
    if legacy is not None:
        return json.loads(Path(legacy).read_text())["chat_template"]
    raise ValueError(f"{path}: neither the tokenizer nor the processor has a chat template")


@functools.cache
def load_feature_extractor(path: str) -> Any:
    return AutoFeatureExtractor.from_pretrained(path)


@functools.cache
def load_image_processor(path: str) -> Qwen2VLImageProcessorPil:
    """The checkpoint's image settings in transformers' PIL/numpy image processor (the default,
    torchvision-backed one does not import beside this CPU torch; both compute the same patches)."""
    return Qwen2VLImageProcessorPil.from_pretrained(path)


def _load(cls: type, source: Source, sub_config: Any, prefix: str, device: str) -> torch.nn.Module:
    if source.random_weights:
        with torch.device(device):
            model = cls._from_config(
                sub_config, dtype=source.dtype, attn_implementation=source.attn_implementation
            )
        init_talker_moe(model, load_config(source.path).talker_config.initializer_range)
        return model.eval().requires_grad_(False)
    # With accelerate installed, weights load straight onto the device; without it (it is not a
    # dependency), they load on the CPU and move.
    placement = {"device_map": device} if importlib.util.find_spec("accelerate") else {}
    model = cls.from_pretrained(
        source.path,
        config=sub_config,
        key_mapping={f"^{prefix}": ""},
        dtype=source.dtype,
        attn_implementation=source.attn_implementation,
        **placement,
    )
    return model.to(device).eval().requires_grad_(False)


@functools.cache
def load_thinker(source: Source, device: str) -> Qwen3OmniMoeThinkerForConditionalGeneration:
    """The thinker's language model and head (its audio and vision towers are dropped: each runs
    in its own stage)."""
    config = load_config(source.path)
    thinker = _load(
        Qwen3OmniMoeThinkerForConditionalGeneration, source, config.thinker_config, r"thinker\.", device
    )
    # The audio and image encoders run in their own stages: free the towers.
    thinker.model.audio_tower = None
    thinker.model.visual = None
    return thinker


@functools.cache
def load_audio_encoder(source: Source, device: str) -> Qwen3OmniMoeAudioEncoder:
    config = load_config(source.path)
    return _load(
        Qwen3OmniMoeAudioEncoder,
        source,
        config.thinker_config.audio_config,
        r"thinker\.audio_tower\.",
        device,
    )


@functools.cache
def load_vision_encoder(source: Source, device: str) -> Qwen3OmniMoeVisionEncoder:
    config = load_config(source.path)
    return _load(
        Qwen3OmniMoeVisionEncoder, source, config.thinker_config.vision_config, r"thinker\.visual\.", device
    )


@functools.cache
def load_talker(source: Source, device: str) -> Qwen3OmniMoeTalkerForConditionalGeneration:
    config = load_config(source.path)
    return _load(
        Qwen3OmniMoeTalkerForConditionalGeneration, source, config.talker_config, r"talker\.", device
    )


@functools.cache
def load_code2wav(source: Source, device: str) -> Qwen3OmniMoeCode2Wav:
    config = load_config(source.path)
    return _load(Qwen3OmniMoeCode2Wav, source, config.code2wav_config, r"code2wav\.", device)
