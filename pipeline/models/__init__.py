"""The model registry: one package per model, each registering a ModelSpec when imported.

Only packages below ``pipeline/models/`` import model code. A package registers its spec in its
``__init__`` (``register(ModelSpec(...))``); ``get_model`` imports every package here once to find
it. Tests register their own small models the same way. A ModelSpec is pickled by reference into
stage processes, so its factories must be module-level functions.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import ConfigError, PipelineConfig, StageConfig
from pipeline.proto import MergeFn


@dataclass(frozen=True)
class StageContext:
    """What a stage factory gets: its stage's config and the preset's model arguments."""

    stage: StageConfig
    model_args: Mapping[str, Any]


StageFactory = Callable[[StageContext], Any]
"""Builds the runner for one stage (a BatchRunner, ARRunner or VocoderRunner, per its scheduler)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    factories: Mapping[str, StageFactory]
    merges: Mapping[str, MergeFn] = field(default_factory=dict)
    output_sample_rate: int | None = None
    # What a request may carry in its messages ("text", "audio", "image", "video"): the server
    # refuses the rest with an error that names these, and lists them in /v1/models.
    input_modalities: tuple[str, ...] = ("text", "audio")
    output_modalities: tuple[str, ...] = ("text", "audio")


_REGISTRY: dict[str, ModelSpec] = {}
_discovered = False


def register(spec: ModelSpec) -> ModelSpec:
    _REGISTRY[spec.name] = spec
    return spec


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            importlib.import_module(f"{__name__}.{info.name}")
    _discovered = True


def get_model(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        _discover()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"pipeline.model: unknown model {name!r} (known: {sorted(_REGISTRY)})"
        ) from None


def resolve(config: PipelineConfig) -> ModelSpec:
    """The config's ModelSpec, after checking that every runner and merge it names exists."""
    spec = get_model(config.model)
    for s in config.stages:
        if s.runner not in spec.factories:
            raise ConfigError(
                f"pipeline.stages.{s.name}.runner: {s.runner!r} is not a stage of model "
                f"{spec.name!r} (has: {sorted(spec.factories)})"
            )
        if s.merge is not None and s.merge not in spec.merges:
            raise ConfigError(
                f"pipeline.stages.{s.name}.merge: {s.merge!r} is not a merge of model "
                f"{spec.name!r} (has: {sorted(spec.merges)})"
            )
    return spec
