"""A stage process that dies while the server serves: the call in progress gets a failed response
with an error (not a hang), /healthz and new calls say so while the runner restarts the process,
and then the same call is answered again."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.calls import QUESTION, TOY_STAGES, open_call, wait_stages_idle
from harness.server import ServerProcess, run_server, write_preset
from harness.speech import speech

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("crash")
    # A slow talker, so that the answer is still being generated when its process dies, and a
    # restart delay long enough for /healthz to be seen reporting the crash.
    preset = write_preset(tmp / "preset.yaml", stages={"talker": {"options": {"step_delay_s": 0.2}}},
                          pipeline={"restart_delay_s": 3.0})
    with run_server(preset, tmp=tmp) as running:
        yield running


def stage_processes(parent: int) -> list[int]:
    """The server's spawned stage processes (not multiprocessing's resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


async def healthz(server: ServerProcess) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.get(f"{server.url}/healthz")


async def test_a_dead_stage_fails_clearly_and_comes_back(server: ServerProcess) -> None:
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
    health = await healthz(server)
    assert health.status_code == 503, health.text  # the restart waits 3 s
    assert health.json()["status"] == "error" and "crashed" in health.json()["error"]
    # The runner restarts the stage processes; the server serves again.
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while (await healthz(server)).status_code != 200:
        assert asyncio.get_running_loop().time() < deadline, server.log()[-3000:]
        await asyncio.sleep(0.2)  # polling another process's health: no event to wait on
    restarted = stage_processes(server.process.pid)
    assert len(restarted) == 2 and not set(restarted) & set(children)
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    again = await call.wait_event("response.done", count=2)
    assert again["response"]["status"] == "completed"
    await call.peer.close()
    await wait_stages_idle(server, TOY_STAGES)
    assert "restarting stage process" in server.log()
