"""A socket reader that dies (the task that reads an endpoint's ZMQ socket, in a stage process or
in the coordinator) is never a silent outage: it is detected, the requests it may have left
waiting fail with a clear error, the pipeline reports it (``Coordinator.failure``, and through it
/healthz) and recovers: a stage process restarts, as after a crash; the coordinator starts a new
reader and serves again once it hears every stage.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY

from duplex.api import health
from duplex.app_state import AppState
from pipeline import runner
from pipeline.coordinator import Coordinator, PipelineError
from pipeline.models import StageContext
from pipeline.models.toy import make_talker
from pipeline.proto import COORDINATOR, Ready, StageCrashed
from pipeline.scheduling import build_scheduler
from pipeline.stage import Stage
from pipeline.transport.zmq_ipc import ZmqEndpoint
from tests.pipeline import deaf_reader
from tests.pipeline.helpers import (
    collect,
    expected_text,
    make_request,
    running,
    toy_config,
    turn,
    wait_clear,
)
from tests.pipeline.test_stage import PEERS, TALKER, Harness

# The first restart waits 1 s: long enough that the outage is seen reported before it ends.
TOY = toy_config(restart_delay_s=1.0)
ANSWER = int(TOY.stage("thinker").options["answer_tokens"])
NAMES = [s.name for s in TOY.stages]


async def healthz(coordinator: Coordinator) -> httpx.Response:
    """/healthz of a server whose pipeline is ``coordinator`` (the real router and app state)."""
    app = FastAPI()
    app.include_router(health.router)
    preset = SimpleNamespace(settings=SimpleNamespace(preset="toy"))
    # Only what /healthz reads: the preset's name and the pipeline.
    app.state.duplex = AppState(preset, None, None, pipeline=coordinator)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
        return await http.get("/healthz")


async def serving_again(coordinator: Coordinator) -> None:
    async with asyncio.timeout(60):
        while not coordinator.ready:
            await asyncio.sleep(0.05)  # readiness arrives as a message; nothing to await on
    assert (await healthz(coordinator)).status_code == 200
    request = make_request(turn("are you back"))
    assert (await collect(coordinator, request)).text == expected_text(request.inputs, ANSWER)
    await wait_clear(coordinator)
    live = {s: REGISTRY.get_sample_value("pipeline_stage_live_requests", {"stage": s}) for s in NAMES}
    assert live == {s: 0.0 for s in NAMES}


async def test_a_stage_whose_reader_is_killed_reports_a_crash_and_stops(directory: Path) -> None:
    endpoints = {n: ZmqEndpoint(n, directory, shm_threshold=1024) for n in (TALKER.name, *PEERS)}
    stage = Stage(TALKER, build_scheduler(TALKER, make_talker(StageContext(TALKER, {}))),
                  endpoints[TALKER.name])
    h = Harness(endpoints, stage)
    try:
        await h.expect(COORDINATOR, Ready)
        endpoints[TALKER.name]._readers[""].cancel()  # the reader of its ordinary lane dies
        crash = await h.expect(COORDINATOR, StageCrashed)
        assert crash.source == TALKER.name and "socket reader failed" in crash.error
        await asyncio.wait_for(h._task, 10)  # run() ends instead of serving deaf forever
        assert stage.failure == crash.error
    finally:
        await h.close()


async def test_a_stage_process_whose_reader_dies_is_reported_and_restarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner, "serve_stage_group", deaf_reader.serve_with_a_reader_that_dies)
    async with running(TOY, "process") as coordinator:
        deaf = coordinator.stage_pids[deaf_reader.GROUP]
        with pytest.raises(PipelineError, match="crashed") as failure:
            await collect(coordinator, make_request(turn("hello there")))
        assert failure.value.stage in {"talker", "code2wav"}  # the stages of that process
        health = await healthz(coordinator)
        assert health.status_code == 503 and health.json()["status"] == "error", health.text
        assert "crashed" in health.json()["error"]
        await serving_again(coordinator)
        assert coordinator.stage_pids[deaf_reader.GROUP] != deaf


async def test_the_coordinator_whose_reader_is_killed_fails_what_is_in_flight_and_recovers() -> None:
    async with running(TOY, "process") as coordinator:
        request = make_request(turn("keep talking"), toy_never_stop=True)
        stream = coordinator.stream(request)
        await asyncio.wait_for(anext(stream), 20)
        coordinator._endpoint._readers[""].cancel()
        with pytest.raises(PipelineError, match="socket reader failed"):
            async with asyncio.timeout(20):
                async for _ in stream:
                    pass
        health = await healthz(coordinator)
        assert health.status_code == 503 and health.json()["status"] == "error", health.text
        assert "socket reader failed" in health.json()["error"]
        await serving_again(coordinator)
