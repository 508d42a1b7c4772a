"""Assembling one stage: its model runner (from the model package's factory), its scheduler and its
merge, behind the Stage IO shell. Shared by every placement (in-process, stage processes, Ray
actors), so a stage is the same code wherever it runs. Pure functions; nothing is kept here."""

from __future__ import annotations

from pipeline.config import PipelineConfig, StageConfig
from pipeline.models import ModelSpec, StageContext
from pipeline.scheduling import build_scheduler
from pipeline.stage import Stage
from pipeline.transport.base import Endpoint

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
"""The log format of a process that runs stages (a stage process, a Ray actor)."""


def build_stage(config: PipelineConfig, spec: ModelSpec, stage: StageConfig, endpoint: Endpoint) -> Stage:
    """The Stage of ``stage`` with its model runner and scheduler, talking through ``endpoint``."""
    runner = spec.factories[stage.runner](StageContext(stage, config.model_args))
    merge = spec.merges[stage.merge] if stage.merge else None
    return Stage(stage, build_scheduler(stage, runner), endpoint, merge)
