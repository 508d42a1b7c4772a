"""Stage processes whose thinker hangs (blocks forever, never dies): entry points a test gives the
runner in place of ``serve_stage_group`` (spawned processes import them by name).

Only the first thinker process of a pipeline hangs (a marker file in the pipeline's IPC directory
says which), once the coordinator's first request reaches it: in ``serve_with_a_worker_that_hangs``
its worker thread blocks in its first step; in ``serve_with_a_reader_that_hangs`` the reader of
its socket takes the request off the socket and then waits forever, reading nothing more. Either
way the stage says nothing (no StageCrashed: nothing died). The restarted process serves normally.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import zmq.asyncio

from pipeline.config import PipelineConfig
from pipeline.proto import Submit
from pipeline.runner import serve_stage_group
from pipeline.scheduling.ar import ARScheduler
from pipeline.scheduling.base import StepResult
from pipeline.transport.zmq_ipc import ZmqEndpoint

GROUP = "thinker"
MARKER = "thinker-hangs"


def _first(group: str, directory: str) -> bool:
    """Whether this is the pipeline's first process of ``GROUP`` (the one that hangs)."""
    marker = Path(directory) / MARKER
    if group != GROUP or marker.exists():
        return False
    marker.touch()
    return True


def serve_with_a_worker_that_hangs(
    config: PipelineConfig, group: str, directory: str, spec: Any
) -> None:
    if _first(group, directory):

        def step_forever(self: ARScheduler) -> list[StepResult]:
            threading.Event().wait()  # a kernel that never returns, a deadlock
            return []

        ARScheduler.step = step_forever  # type: ignore[method-assign]
    serve_stage_group(config, group, directory, spec)


def serve_with_a_reader_that_hangs(
    config: PipelineConfig, group: str, directory: str, spec: Any
) -> None:
    if _first(group, directory):
        read = ZmqEndpoint._read

        async def read_until_a_request(self: ZmqEndpoint, sock: zmq.asyncio.Socket) -> None:
            if self.name != GROUP or sock is not self._pulls[""]:
                return await read(self, sock)
            while True:
                frames = await sock.recv_multipart()
                # The pickle of a message names its class. The request is never delivered, nor
                # anything after it.
                if Submit.__name__.encode() in frames[-1]:
                    await asyncio.Event().wait()
                self._take(frames)

        ZmqEndpoint._read = read_until_a_request  # type: ignore[method-assign]
    serve_stage_group(config, group, directory, spec)
