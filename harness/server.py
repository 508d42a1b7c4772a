"""A real ``python -m duplex.serve`` in a subprocess, for end-to-end tests and benchmarks.

Use inside the loopback-only namespace (``make test`` runs pytest in one). The server is started
with a preset file written for the test (``write_preset``) and stopped with SIGINT, as a user would.
``serving`` runs an app in the test's own process instead (uvicorn on loopback), for tests that
look at the server's objects.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 300.0  # the offline preset converts its language model on first use


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_preset(path: Path, base: str = "toy", stages: dict[str, dict[str, Any]] | None = None,
                 pipeline: dict[str, Any] | None = None, **overrides: Any) -> Path:
    """``configs/{base}.yaml`` with top-level ``overrides`` (e.g. ``session={...}``), fields of its
    ``pipeline`` section to replace, and per stage name fields of that stage to replace (its
    ``options`` are merged, not replaced)."""
    data = yaml.safe_load((ROOT / "configs" / f"{base}.yaml").read_text())
    data["pipeline"].update(pipeline or {})
    for stage in data["pipeline"]["stages"]:
        changes = dict((stages or {}).get(stage["name"], {}))
        stage["options"] = {**stage.get("options", {}), **changes.pop("options", {})}
        stage.update(changes)
    data.update(overrides)
    path.write_text(yaml.safe_dump(data))
    return path


def every_stage(base: str, **fields: Any) -> dict[str, dict[str, Any]]:
    """``write_preset``'s ``stages`` giving each stage of ``configs/{base}.yaml`` the same
    ``fields`` (e.g. ``process="stages"``: one stage process, half the startup on 2 cores)."""
    data = yaml.safe_load((ROOT / "configs" / f"{base}.yaml").read_text())
    return {stage["name"]: dict(fields) for stage in data["pipeline"]["stages"]}


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, labels: dict[str, str] | None = None, headers: dict[str, str] | None = None) -> float:
        """The value of one sample of ``/metrics``; a sample that is not there fails the caller
        (a renamed or missing gauge must not read as an idle zero)."""
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        want = ",".join(f'{k}="{v}"' for k, v in (labels or {}).items())
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            if key == name or (want and key == f"{name}{{{want}}}"):
                return float(value)
        raise AssertionError(f"no sample {name}{{{want}}} in /metrics")


@contextmanager
def run_server(preset: Path, *args: str, tmp: Path) -> Iterator[ServerProcess]:
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "duplex.serve", "--config", str(preset), "--port", str(port),
             "--ice-host", "127.0.0.1", *args],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_healthy(server)
        yield server
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_healthy(server: ServerProcess) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # polling a subprocess's readiness: no event to wait on across processes
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S:.0f}s:\n{server.log()}")


@asynccontextmanager
async def serving(app: Any, lifespan: str = "off", timeout: float = 30.0) -> AsyncIterator[int]:
    """``app`` served by uvicorn on a free loopback port of this process (yielded) until the block
    ends."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_config=None,
                                           lifespan=lifespan))
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(timeout):
        while not server.started:
            await asyncio.sleep(0.02)  # uvicorn sets a flag, with no event to wait on
    try:
        yield server.config.port
    finally:
        server.should_exit = True
        await task
