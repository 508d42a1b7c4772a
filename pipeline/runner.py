"""Starts one PipelineConfig, in this process or as stage processes, and returns its Coordinator.

``mode="process"`` (the default for serving) runs each process group of the config in its own OS
process (spawned, so no model state is inherited), with a ZMQ control plane and shared-memory
tensors; model compute then never shares a GIL with the event loop that paces audio.
``mode="inproc"`` runs every stage in this process on asyncio queues (tests, benchmarks).
A preset with ``placement: ray`` runs each stage as a Ray actor instead, whatever the mode
(``pipeline.placement``: the stages may live on other hosts and be shared by several front ends).

The runner owns the stage tasks, or the IPC directory and the ProcessSupervisor (which starts,
watches and restarts the stage processes), or the RaySupervisor of this front end; ``Coordinator.close``
stops and removes them, or leaves the shared stage actors (through the coordinator's ``shutdown_hook``).
A stage process in which a stage cannot serve any more (its worker thread or its socket reader died)
exits, so that the supervisor restarts it as after a crash.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Literal, NoReturn

import zmq

from pipeline.assembly import LOG_FORMAT, build_stage
from pipeline.config import PipelineConfig, StageConfig
from pipeline.coordinator import Coordinator, PipelineError
from pipeline.models import ModelSpec, resolve
from pipeline.proto import COORDINATOR, StageCrashed
from pipeline.stage import Stage
from pipeline.supervisor import ProcessSupervisor
from pipeline.transport.base import LAST_WORDS_LINGER_MS
from pipeline.transport.inproc import InprocHub
from pipeline.transport.zmq_ipc import ZmqEndpoint

log = logging.getLogger(__name__)

Mode = Literal["inproc", "process"]
_JOIN_TIMEOUT_S = 10.0


async def start_pipeline(
    config: PipelineConfig, mode: Mode = "process", ready_timeout: float = 600.0
) -> Coordinator:
    """Start every stage and return the coordinator once all are Ready (raises PipelineError)."""
    spec = resolve(config)
    if config.placement == "ray":
        coordinator = await _start_ray(config, spec, ready_timeout)
    elif mode == "inproc":
        coordinator = await _start_inproc(config, spec)
    else:
        coordinator = _start_processes(config, spec)
    try:
        await coordinator.wait_ready(ready_timeout)
    except BaseException:
        await coordinator.close()
        raise
    where = "ray actors" if config.placement == "ray" else mode
    log.info("pipeline ready: model %s, %d stages, %s", config.model, len(config.stages), where)
    return coordinator


async def _start_inproc(config: PipelineConfig, spec: ModelSpec) -> Coordinator:
    hub = InprocHub()
    coordinator = Coordinator(config, hub.endpoint(COORDINATOR), spec.output_sample_rate,
                              spec.input_modalities)
    coordinator.start()
    tasks: list[asyncio.Task[None]] = []

    async def shutdown() -> None:
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), _JOIN_TIMEOUT_S)

    def on_exit(task: asyncio.Task[None], stage: str) -> None:
        # A stage task ends by itself only at Shutdown; one that raised is a dead stage, reported
        # like a dead stage process so that its requests fail instead of hanging.
        if not task.cancelled() and task.exception() is not None:
            coordinator.on_stage_crashed(stage, f"stage task failed: {task.exception()!r}")

    coordinator.shutdown_hook = shutdown
    for stage in config.stages:
        endpoint = hub.endpoint(stage.name)
        try:
            built = await asyncio.to_thread(build_stage, config, spec, stage, endpoint)
        except Exception as err:
            await coordinator.close()
            raise PipelineError(stage.name, f"could not start: {err}") from err
        task = asyncio.create_task(built.run(), name=f"stage-{stage.name}")
        task.add_done_callback(functools.partial(on_exit, stage=stage.name))
        tasks.append(task)
    return coordinator


def _start_processes(config: PipelineConfig, spec: ModelSpec) -> Coordinator:
    directory = Path(tempfile.mkdtemp(prefix="duplex-ipc-"))
    coordinator = Coordinator(
        config, ZmqEndpoint(COORDINATOR, directory, config.shm_threshold_bytes), spec.output_sample_rate,
        spec.input_modalities,
    )
    coordinator.start()
    supervisor = ProcessSupervisor(config, coordinator, serve_stage_group, (str(directory), spec))
    supervisor.start()
    coordinator.kill_hook = supervisor.kill

    async def shutdown() -> None:
        await supervisor.stop()
        shutil.rmtree(directory, ignore_errors=True)

    coordinator.shutdown_hook = shutdown
    return coordinator


async def _start_ray(config: PipelineConfig, spec: ModelSpec, ready_timeout: float) -> Coordinator:
    # Imported here: Ray is an optional dependency (the ``ray`` extra), needed only by this mode.
    from pipeline.placement.ray_supervisor import RaySupervisor, find_or_create_stages

    handles = await asyncio.to_thread(find_or_create_stages, config)
    supervisor = RaySupervisor(config, handles)
    coordinator = Coordinator(config, supervisor.endpoint, spec.output_sample_rate,
                              spec.input_modalities)
    coordinator.shutdown_hook = supervisor.stop
    coordinator.start()
    supervisor.start(coordinator)
    try:
        await supervisor.describe(ready_timeout)
    except BaseException:
        await coordinator.close()
        raise
    log.info("stage actors: %s", {s: i["node_id"][:8] for s, i in supervisor.placement.items()})
    return coordinator


# --- inside a stage process ------------------------------------------------------------------


def serve_stage_group(config: PipelineConfig, group: str, directory: str, spec: ModelSpec) -> None:
    """Entry point of one stage process: build its stages and serve until Shutdown."""
    logging.basicConfig(level=os.environ.get("DUPLEX_LOG_LEVEL", "INFO"), format=LOG_FORMAT)
    stages = config.process_groups[group]
    import torch

    torch.set_num_threads(max(s.threads for s in stages))
    asyncio.run(_serve_group(config, stages, Path(directory), spec))
    # Everything is released by now (endpoints closed, shared memory unlinked); the interpreter's
    # own teardown of torch and ZMQ takes seconds and would only delay Coordinator.close.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _serve_group(
    config: PipelineConfig, stages: list[StageConfig], directory: Path, spec: ModelSpec
) -> None:
    neighbours: dict[str, ZmqEndpoint] = {}
    endpoints = {
        s.name: ZmqEndpoint(s.name, directory, config.shm_threshold_bytes, neighbours) for s in stages
    }
    built: list[Stage] = []
    for stage in stages:
        try:
            built.append(await asyncio.to_thread(build_stage, config, spec, stage, endpoints[stage.name]))
        except Exception as err:  # noqa: BLE001 - reported to the coordinator, then exit
            log.exception("stage %s could not start", stage.name)
            detail = "".join(traceback.format_exception_only(err)).strip()
            endpoints[stage.name].send(COORDINATOR, StageCrashed(stage.name, f"could not start: {detail}"))
            for endpoint in endpoints.values():
                endpoint.close(linger_ms=LAST_WORDS_LINGER_MS)  # deliver the report before exiting
            raise SystemExit(1) from err
    watchdog = asyncio.create_task(_exit_with_parent(os.getppid()))
    running = {asyncio.create_task(stage.run(), name=f"stage-{stage.name}") for stage in built}
    while running:
        done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
        dead = [stage.name for stage in built if stage.failure is not None]
        if dead:
            # A stage that cannot serve (its worker or socket reader died) told the coordinator
            # why; the process exits, so that the supervisor reports every stage of it and starts
            # it again, as for a crash (and removes the shared memory it held).
            log.error("stages %s cannot serve: stage process exits", dead)
            for endpoint in endpoints.values():
                endpoint.close(linger_ms=LAST_WORDS_LINGER_MS)
            _flush_and_exit(1)
    watchdog.cancel()


def _flush_and_exit(code: int) -> NoReturn:
    """Exit once ZMQ delivered what the closed endpoints still queued (a StageCrashed), or gave
    up after their linger: a term that never returns must not keep a dead stage alive."""
    flush = threading.Thread(target=zmq.Context.instance().term, daemon=True)
    flush.start()
    flush.join(LAST_WORDS_LINGER_MS / 1000 + 1.0)
    logging.shutdown()
    os._exit(code)


async def _exit_with_parent(parent: int) -> None:
    """A stage process must not outlive the server that started it (e.g. after a kill -9)."""
    while True:
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            log.error("parent process %d is gone; stage process exits", parent)
            os._exit(1)
