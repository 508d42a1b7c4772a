"""The Qwen3-Omni presets and the GPU check's CPU-testable parts.

No GPU here: what can be checked is that both presets resolve against the model's stages, that
the GPU check builds a valid pipeline from the real preset, that its checkpoint without weights
describes the real 35B architecture (built on the meta device, so nothing is allocated), and that
weights drawn at load hold no uninitialised memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, Qwen3OmniMoeForConditionalGeneration

from evaluation.qwen3_gpu_check import check_config, checkpoint
from pipeline.config import parse_pipeline_config, read_yaml
from pipeline.models import resolve
from pipeline.models.qwen3_omni import loading, tiny
from pipeline.models.qwen3_omni.synthetic import full_size_config_dict
from tests.models.conftest import REPO


@pytest.mark.parametrize("preset", ["qwen3_omni", "qwen3_omni_tiny"])
def test_presets_resolve(preset: str) -> None:
    data = read_yaml(REPO / "configs" / f"{preset}.yaml")
    assert data["name"] == preset and data["description"]
    config = parse_pipeline_config(data["pipeline"])
    assert resolve(config).output_sample_rate == 24000
    # Clients may pick "default" (the talker stage's voice) or any speaker of the checkpoint.
    speakers = full_size_config_dict()["talker_config"]["speaker_id"]
    assert data["voices"][0] == "default" and set(data["voices"][1:]) == set(speakers) == set(tiny.SPEAKERS)
    assert set(config.terminals) == {"decode", "code2wav", "transcribe"}
    if preset == "qwen3_omni":
        assert {s.device for s in config.stages if s.name in ("thinker", "talker", "code2wav")} == {"cuda:0"}
    else:
        assert {s.device for s in config.stages} == {"cpu"}
        assert sum(max(s.threads for s in g) for g in config.process_groups.values()) <= 2


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint("full", tmp_path_factory.mktemp("full-random"))


def test_gpu_check_serves_the_real_preset_with_drawn_weights(full_checkpoint: Path) -> None:
    config = check_config(full_checkpoint, "cuda:0", "bfloat16")
    assert config.model_args == {"checkpoint": str(full_checkpoint), "dtype": "bfloat16", "random_weights": True}
    real = parse_pipeline_config(read_yaml(REPO / "configs" / "qwen3_omni.yaml")["pipeline"])
    assert [(s.name, s.device, s.process) for s in config.stages] == [
        (s.name, s.device, s.process) for s in real.stages
    ]
    assert "RANDOM" in loading.describe(loading.resolve(config.model_args))


def test_the_random_checkpoint_is_the_full_size_architecture(full_checkpoint: Path) -> None:
    config = AutoConfig.from_pretrained(full_checkpoint)
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(config)
    billions = {n: sum(p.numel() for p in getattr(model, n).parameters()) / 1e9
                for n in ("thinker", "talker", "code2wav")}
    assert 31.5 < billions["thinker"] < 32.0 and 3.2 < billions["talker"] < 3.4
    assert 35.0 < sum(billions.values()) < 35.5  # Qwen3-Omni-30B-A3B: 35.3B parameters
    tokenizer = loading.load_tokenizer(str(full_checkpoint))
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == config.im_end_token_id == 151645
    assert tokenizer.convert_tokens_to_ids("<|audio_pad|>") == config.thinker_config.audio_token_id


def test_drawn_weights_are_all_initialised(tmp_path: Path) -> None:
    path = checkpoint("tiny", tmp_path)
    source = loading.resolve({"checkpoint": str(path), "dtype": "float32", "random_weights": True})
    talker = loading.load_talker(source, "cpu")
    for name, param in talker.named_parameters():
        assert torch.isfinite(param).all(), name
    experts = talker.model.layers[0].mlp.experts
    assert experts.gate_up_proj.std() > 0 and talker.model.layers[0].mlp.gate.weight.std() > 0
