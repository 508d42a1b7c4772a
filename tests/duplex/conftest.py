"""Fixtures of the session-layer tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pipeline.config import parse_pipeline_config, read_yaml
from pipeline.coordinator import Coordinator
from pipeline.runner import start_pipeline

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
async def pipeline() -> AsyncIterator[Coordinator]:
    """The toy preset's pipeline in this process, shared by a module's sessions."""
    config = parse_pipeline_config(read_yaml(ROOT / "configs" / "toy.yaml")["pipeline"])
    coordinator = await start_pipeline(config, mode="inproc")
    yield coordinator
    await coordinator.close()
