"""Supervision of a pipeline's stage processes: start, watch, restart with back-off, stop.

A :class:`ProcessSupervisor` owns one OS process per process group of a PipelineConfig (spawned, so
no model state is inherited) from ``start`` to ``stop``. When a process dies, every stage in it is
reported to the coordinator as crashed (which fails what is in flight and refuses new requests),
its shared-memory segments are removed, and the process is started again after a delay
(``restart_delay_s``) that doubles while it keeps dying (and starts over once it has lived ``RESTART_RESET_S``); the
coordinator serves again once the new process's stages are Ready. A process with a stage that
hangs (the coordinator's ``kill_hook``) is killed, and then goes the same way.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.coordinator import Coordinator
from pipeline.transport.shm import remove_segments_of

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0
RESTART_MAX_DELAY_S = 30.0
RESTART_RESET_S = 60.0


class ProcessSupervisor:
    """See module doc. ``target(group, *args)`` is the entry point of each stage process."""

    def __init__(self, config: PipelineConfig, coordinator: Coordinator,
                 target: Callable[..., None], args: tuple[Any, ...]) -> None:
        self._config = config
        self._coordinator = coordinator
        self._target = target
        self._args = args
        self._context = multiprocessing.get_context("spawn")
        self._processes: dict[str, BaseProcess] = {}
        self._crashes: dict[str, tuple[int, float]] = {}  # group -> (deaths in a row, last death)
        self._killed: dict[str, str] = {}  # group -> why it was killed, until its exit is seen
        self._restarts: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._loop = asyncio.get_running_loop()

    @property
    def pids(self) -> dict[str, int | None]:
        return {group: process.pid for group, process in self._processes.items()}

    def start(self) -> None:
        for group in self._config.process_groups:
            self._spawn(group)
        log.info("stage processes: %s", self.pids)

    def _spawn(self, group: str) -> None:
        process = self._context.Process(target=self._target, args=(self._config, group, *self._args),
                                        name=f"duplex-stage-{group}", daemon=True)
        process.start()
        self._processes[group] = process
        self._loop.add_reader(process.sentinel, self._on_exit, group)
        for stage in self._config.process_groups[group]:
            self._coordinator.stage_pids[stage.name] = process.pid

    def kill(self, stage: str, why: str) -> None:
        """Kill the process of ``stage``, which hangs (``why``); it restarts as after a crash."""
        group = self._config.stage(stage).process
        process = self._processes.get(group)
        if self._stopping or process is None or not process.is_alive():
            return
        log.error("killing stage process %r (pid %s): stage %s: %s", group, process.pid, stage, why)
        self._killed[group] = f"stage {stage}: {why}"
        process.kill()

    def _on_exit(self, group: str) -> None:
        process = self._processes[group]
        self._loop.remove_reader(process.sentinel)
        if self._stopping:
            return
        process.join()
        killed = self._killed.pop(group, None)
        how = f"was killed ({killed})" if killed else f"exited with code {process.exitcode}"
        for stage in self._config.process_groups[group]:
            self._coordinator.on_stage_crashed(
                stage.name, f"process {group!r} (pid {process.pid}) {how}"
            )
        if process.pid is not None:
            remove_segments_of(process.pid)
        task = self._loop.create_task(self._restart(group))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, group: str) -> None:
        """Bring a dead stage process back, waiting longer each time it dies again soon."""
        count, last = self._crashes.get(group, (0, 0.0))
        now = self._loop.time()
        count = 0 if now - last > RESTART_RESET_S else count
        self._crashes[group] = (count + 1, now)
        delay = min(RESTART_MAX_DELAY_S, self._config.restart_delay_s * 2**count)
        log.warning("restarting stage process %r in %.1f s", group, delay)
        await asyncio.sleep(delay)
        if not self._stopping:
            self._spawn(group)

    async def stop(self) -> None:
        """Stop every process (they exit on the coordinator's Shutdown) and its shared memory."""
        self._stopping = True
        for task in self._restarts:
            task.cancel()
        for process in self._processes.values():
            self._loop.remove_reader(process.sentinel)
        await asyncio.gather(*(asyncio.to_thread(_join, p) for p in self._processes.values()))
        for process in self._processes.values():
            if process.pid is not None:
                remove_segments_of(process.pid)


def _join(process: BaseProcess) -> None:
    process.join(JOIN_TIMEOUT_S)
    if process.is_alive():
        log.error("stage process %s did not stop; killing it", process.name)
        process.kill()
        process.join()
