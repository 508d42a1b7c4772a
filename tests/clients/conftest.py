"""The server the client tests share: the toy preset with answers long enough to talk over (40
words; the talker at 25 ms a frame generates 9.6 s of audio in about 3 s), an API key as clients
send one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.server import ServerProcess, run_server, write_preset
from tests.api.helpers import API_KEY, toy_pipeline

PIPELINE = toy_pipeline(thinker={"options": {"answer_tokens": 40}}, talker={"options": {"step_delay_s": 0.025}})


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("clients")
    preset = write_preset(tmp / "preset.yaml", pipeline=PIPELINE, api_key=API_KEY)
    with run_server(preset, tmp=tmp) as running:
        yield running
