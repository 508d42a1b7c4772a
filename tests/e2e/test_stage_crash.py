"""A stage process that dies while the server serves: the call in progress gets a failed response
with an error (not a hang), /healthz says why, and new calls are refused clearly."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_webrtc_calls import QUESTION, open_call
from tests.server import ServerProcess, run_server, write_preset
from tests.speech import speech


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("crash")
    # A slow talker, so that the answer is still being generated when its process dies.
    preset = write_preset(tmp / "preset.yaml")
    text = preset.read_text().replace("step_delay_s: 0.002", "step_delay_s: 0.2")
    preset.write_text(text)
    with run_server(preset, tmp=tmp) as running:
        yield running


def stage_processes(parent: int) -> dict[int, str]:
    """The server's spawned stage processes (not multiprocessing's resource tracker): pid → name."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and "spawn_main" in cmdline:
            found[int(entry.name)] = cmdline
    return found


async def test_a_dead_stage_fails_clearly(server: ServerProcess) -> None:
    assert "step_delay_s: 0.2" in Path(server.log_path.parent / "preset.yaml").read_text()
    children = stage_processes(server.process.pid)
    assert len(children) == 2, children
    call = await open_call(server)
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    await call.wait_event("output_audio_buffer.started")
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    done = await call.wait_event("response.done")
    assert done["response"]["status"] == "failed"
    error = await call.wait_event("error")
    assert "crashed" in error["error"]["message"]
    async with httpx.AsyncClient() as http:
        health = await http.get(f"{server.url}/healthz")
        assert health.status_code == 503
        assert health.json()["status"] == "error" and "crashed" in health.json()["error"]
        refused = await http.post(f"{server.url}/v1/realtime/calls", content="v=0",
                                  headers={"Content-Type": "application/sdp"})
        assert refused.status_code == 503
        assert refused.headers["retry-after"]
    await call.peer.close()
