"""Fixtures of the model tests: the tiny Qwen3-Omni preset, its checkpoint and the reference model.

The tiny checkpoint is built on first use into the duplex cache (a few seconds), then every test
loads it through the same ``from_pretrained`` path as the real model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import Qwen3OmniMoeForConditionalGeneration
from transformers.utils import logging as hf_logging

from pipeline.config import PipelineConfig, parse_pipeline_config, read_yaml
from pipeline.models.qwen3_omni import loading
from pipeline.models.qwen3_omni.reference import load_reference

REPO = Path(__file__).resolve().parents[2]
TINY_PRESET = REPO / "configs" / "qwen3_omni_tiny.yaml"

# transformers reports every unused key of the composite checkpoint when a stage loads its part.
hf_logging.set_verbosity_error()


def tiny_config(**stage_options: dict) -> PipelineConfig:
    """The tiny preset's pipeline, with ``options`` of named stages updated."""
    data = read_yaml(TINY_PRESET)["pipeline"]
    stages = [
        {**s, "options": {**s.get("options", {}), **stage_options.get(s["name"], {})}}
        for s in data["stages"]
    ]
    return parse_pipeline_config({**data, "stages": stages})


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """In-process pipelines step several stages from their own threads: one intra-op thread each
    keeps them from oversubscribing a 2-core machine (stage processes set their own counts)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_source() -> loading.Source:
    return loading.resolve(tiny_config().model_args)


@pytest.fixture(scope="session")
def reference_model(tiny_source: loading.Source) -> Qwen3OmniMoeForConditionalGeneration:
    return load_reference(tiny_source)
