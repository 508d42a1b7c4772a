"""Fixtures of the pipeline tests: every module that starts pipelines runs once per runner mode."""

from __future__ import annotations

import pytest

from tests.pipeline.helpers import MODES


@pytest.fixture(scope="module", params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """``inproc`` (every stage on this event loop) or ``process`` (stage processes, ZMQ + shm)."""
    return request.param
