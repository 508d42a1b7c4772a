"""Fixtures of the pipeline tests: every module that starts pipelines runs once per runner mode,
sharing one pipeline of each shape per module (a stage process costs seconds to start)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from pipeline.coordinator import Coordinator
from tests.pipeline.helpers import MODES, fan_in_config, running, toy_config


@pytest.fixture(scope="module", params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """``inproc`` (every stage on this event loop) or ``process`` (stage processes, ZMQ + shm)."""
    return request.param


@pytest.fixture(scope="module")
async def toy(mode: str, request: pytest.FixtureRequest) -> AsyncIterator[Coordinator]:
    """The toy preset's shape; a module may set its own variant as a module-level ``TOY``."""
    async with running(getattr(request.module, "TOY", toy_config()), mode) as coordinator:
        yield coordinator


@pytest.fixture(scope="module")
async def fan_in(mode: str) -> AsyncIterator[Coordinator]:
    """split -> (a, b) -> join -> tail (see ``fan_in_config``)."""
    async with running(fan_in_config(), mode) as coordinator:
        yield coordinator


@pytest.fixture
def directory() -> Iterator[Path]:
    """A fresh directory for ipc:// sockets, with a short path (they are length-limited)."""
    path = Path(tempfile.mkdtemp(prefix="duplex-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
