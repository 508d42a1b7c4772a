"""Schedulers: ``simple``, ``ar`` and ``vocoder``, all behind the Scheduler protocol (base.py)."""

from __future__ import annotations

from typing import Any

from pipeline.config import StageConfig
from pipeline.scheduling.ar import ARScheduler
from pipeline.scheduling.base import Scheduler
from pipeline.scheduling.simple import SimpleScheduler
from pipeline.scheduling.vocoder import VocoderScheduler


def build_scheduler(stage: StageConfig, runner: Any) -> Scheduler:
    """The scheduler a stage's config names, driving the runner its factory built."""
    match stage.scheduler:
        case "simple":
            return SimpleScheduler(runner, stage.max_batch)
        case "ar":
            assert stage.max_new_tokens is not None  # enforced by StageConfig
            return ARScheduler(runner, stage.max_batch, stage.max_new_tokens, stage.cap_param)
        case "vocoder":
            return VocoderScheduler(
                runner, stage.max_batch, stage.chunk_frames, stage.first_chunk_frames
            )
