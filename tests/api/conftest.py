"""The server every module of tests/api shares (see helpers.py for why its answers are long)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.server import ServerProcess, run_server, write_preset
from tests.api.helpers import API_KEY, MAX_SESSIONS, PIPELINE


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("api")
    preset = write_preset(tmp / "preset.yaml", pipeline=PIPELINE, api_key=API_KEY,
                          max_sessions=MAX_SESSIONS)
    with run_server(preset, tmp=tmp) as running:
        yield running
