"""Fixtures of the operators' tests (idle and length limits, recordings, call control)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml

from duplex.app_state import AppState
from duplex.app import create_app
from duplex.settings import load_preset
from duplex.transports.webrtc.ice import IcePolicy
from harness.server import ROOT, free_port
from pipeline.config import parse_pipeline_config
from pipeline.coordinator import Coordinator
from pipeline.proto import OmniRequest, OutputChunk
from pipeline.runner import start_pipeline
from tests.telephony.peers import wait_until

ANSWER_TOKENS = 12  # the toy's words an answer: 12 x 3 frames of 80 ms = 2.88 s of audio


def toy_pipeline(answer_tokens: int = ANSWER_TOKENS) -> dict[str, Any]:
    """configs/toy.yaml's pipeline, its answers ``answer_tokens`` words long."""
    pipeline = yaml.safe_load((ROOT / "configs" / "toy.yaml").read_text())["pipeline"]
    for stage in pipeline["stages"]:
        if stage["name"] == "thinker":
            stage["options"] = {**stage.get("options", {}), "answer_tokens": answer_tokens}
    return pipeline


class SpyPipeline:
    """A Coordinator that keeps every request it was asked (to read their instructions)."""

    def __init__(self, inner: Coordinator) -> None:
        self.inner = inner
        self.requests: list[OmniRequest] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def stream(self, request: OmniRequest) -> AsyncIterator[OutputChunk]:
        self.requests.append(request)
        return self.inner.stream(request)

    def said(self) -> list[str | None]:
        """Each request's ``say`` (the words its answer must be), in order."""
        return [r.params.get("say") for r in self.requests]

    def instructions(self) -> list[str]:
        """Each request's system text, in order."""
        return [" ".join(m["text"] or "" for m in r.inputs["messages"] if m["role"] == "system")
                for r in self.requests]


@pytest.fixture(scope="module")
async def make_pipeline() -> AsyncIterator[Callable[[int], Any]]:
    """``await make_pipeline(answer_tokens)``: an in-process toy pipeline, closed with the module."""
    started: list[Coordinator] = []

    async def make(answer_tokens: int = ANSWER_TOKENS) -> SpyPipeline:
        coordinator = await start_pipeline(parse_pipeline_config(toy_pipeline(answer_tokens)), mode="inproc")
        started.append(coordinator)
        return SpyPipeline(coordinator)

    yield make
    for coordinator in started:
        await coordinator.close()


@dataclass
class Served:
    """A duplex server running in the test's process: its app and state, its pipeline spied on,
    and an HTTP client for it."""

    app: Any
    state: AppState
    pipeline: SpyPipeline
    http: httpx.AsyncClient


@asynccontextmanager
async def served(preset: Path, timeout: float) -> AsyncIterator[Served]:
    """The server of the ``preset`` file on a free loopback port, with its lifespan (the pipeline,
    the SIP server), once its pipeline serves; stopped when the block ends."""
    port = free_port()
    app = create_app(load_preset(["--config", str(preset), "--port", str(port)], environ={}),
                     IcePolicy(hosts=("127.0.0.1",)))
    state: AppState = app.state.duplex
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    serving = asyncio.create_task(server.serve())
    try:
        await wait_until(lambda: server.started and state.serving_pipeline() is not None, 60)
        state.pipeline = spy = SpyPipeline(state.pipeline)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=timeout) as http:
            yield Served(app, state, spy, http)
    finally:
        server.should_exit = True
        await serving
