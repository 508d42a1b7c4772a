"""A stage process whose talker's socket reader raises: the entry point a test gives the runner
in place of ``serve_stage_group`` (spawned processes import it by name).

The first talker process of a pipeline (a marker file in the pipeline's IPC directory says which)
has its reader raise once it has taken the first piece of the thinker's stream for the talker, so
that the reader dies in the middle of an answer; the restarted process serves normally.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.proto import StreamChunk
from pipeline.runner import serve_stage_group
from pipeline.transport.zmq_ipc import ZmqEndpoint

GROUP = "talker"
MARKER = "talker-reader-killed"


def serve_with_a_reader_that_dies(
    config: PipelineConfig, group: str, directory: str, spec: Any
) -> None:
    marker = Path(directory) / MARKER
    if group == GROUP and not marker.exists():
        marker.touch()
        take = ZmqEndpoint._take

        def take_then_die(self: ZmqEndpoint, frames: list[bytes]) -> None:
            take(self, frames)
            # The pickle of a message names its class.
            if self.name == GROUP and StreamChunk.__name__.encode() in frames[-1]:
                raise RuntimeError("reader killed by the test")

        ZmqEndpoint._take = take_then_die  # type: ignore[method-assign]
    serve_stage_group(config, group, directory, spec)
