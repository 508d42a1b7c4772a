"""The server the client tests share: the toy preset with answers long enough to talk over (40
words; the talker at 25 ms a frame generates 9.6 s of audio in about 3 s), an API key as clients
send one, and a toy that calls the first tool a client offers for each user turn (and answers the
function's result in words): frameworks offer tools with ``tool_choice: "auto"``, which the toy
otherwise never uses. Tests that offer no tools get spoken answers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.server import ServerProcess, run_server, write_preset
from tests.api.helpers import API_KEY, toy_pipeline

PIPELINE = toy_pipeline(thinker={"options": {"answer_tokens": 40, "call_offered_tools": True}},
                        talker={"options": {"step_delay_s": 0.025}})


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("clients")
    preset = write_preset(tmp / "preset.yaml", pipeline=PIPELINE, api_key=API_KEY)
    with run_server(preset, tmp=tmp) as running:
        yield running
