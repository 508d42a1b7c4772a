"""StageActor: one pipeline stage inside a Ray actor, the same Stage, scheduler and runner code as
in a stage process; only its Endpoint (``pipeline.transport.ray_endpoint.StageEndpoint``) differs.

Lifetime: a named, detached actor (``actor_name(prefix, stage)``) created by the first front end
that needs it and found by name by every later one, so that all of them submit to one stage and
its scheduler batches their requests together. It lives until it is removed
(``ray_supervisor.remove_stages``) or the cluster stops. When its process or node dies, Ray
constructs it again (``ray_max_restarts``): a fresh Stage that holds nothing, under a new
``incarnation``, by which the front ends learn that it restarted even between two polls.

The Stage's event loop is the actor's own (an async actor): it is started by the first call.
A stage whose worker thread dies exits its actor, so that Ray restarts it. A stage that cannot be
built does not raise (Ray would restart it forever): it reports StageCrashed to every front end
that polls it, and its front end removes it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import traceback
import uuid
from typing import Any

import ray

from pipeline.assembly import LOG_FORMAT, build_stage
from pipeline.config import PipelineConfig
from pipeline.models import resolve
from pipeline.proto import StageCrashed
from pipeline.stage import Stage
from pipeline.transport.ray_endpoint import StageEndpoint

log = logging.getLogger(__name__)

CRASH_EXIT_DELAY_S = 0.5


def config_digest(config: PipelineConfig) -> str:
    """A short hash of what the stages run (not of how a front end reaches the cluster)."""
    text = config.model_dump_json(exclude={"ray_address"})
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def actor_prefix(config: PipelineConfig) -> str:
    """The names of this config's stage actors start with this: front ends with equal configs (or
    the same ``ray_name``) share one set of stage actors."""
    return config.ray_name or f"duplex-{config.model}-{config_digest(config)}"


def actor_name(prefix: str, stage: str) -> str:
    return f"{prefix}.{stage}"


class StageActor:
    """See module doc. Wrapped by ``ray.remote`` in the supervisor, with the stage's resources."""

    def __init__(self, config: PipelineConfig, stage: str) -> None:
        logging.basicConfig(level=os.environ.get("DUPLEX_LOG_LEVEL", "INFO"), format=LOG_FORMAT)
        self._stage_name = stage
        self._prefix = actor_prefix(config)
        self._digest = config_digest(config)
        self._incarnation = uuid.uuid4().hex
        self._namespace = config.ray_namespace
        self._handles: dict[str, Any] = {}
        self._endpoint = StageEndpoint(stage, self._lookup, self._on_crashed)
        self._task: asyncio.Task[None] | None = None
        stage_config = config.stage(stage)
        import torch

        torch.set_num_threads(stage_config.threads)
        self._stage: Stage | None = None
        try:
            self._stage = build_stage(config, resolve(config), stage_config, self._endpoint)
        except Exception as err:  # noqa: BLE001 - reported to the front ends, who remove the actor
            log.exception("stage %s could not start", stage)
            detail = "".join(traceback.format_exception_only(err)).strip()
            self._endpoint.set_status(StageCrashed(stage, f"could not start: {detail}"))

    def _lookup(self, stage: str) -> Any:
        handle = self._handles.get(stage)
        if handle is None:
            # Once per target; the handle stays valid across the target's restarts.
            handle = ray.get_actor(actor_name(self._prefix, stage), namespace=self._namespace)
            self._handles[stage] = handle
        return handle

    def _ensure_started(self) -> None:
        if self._stage is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._stage.run())
            self._task.add_done_callback(self._on_stage_exit)

    def _on_crashed(self) -> None:
        # The worker thread died (a scheduler bug): nothing would compute here again. Exit once
        # the polls waiting here had a moment to carry the report out; Ray restarts the actor.
        asyncio.get_running_loop().call_later(CRASH_EXIT_DELAY_S, os._exit, 1)

    def _on_stage_exit(self, task: asyncio.Task[None]) -> None:
        # A Stage ends by itself only at Shutdown, which no front end sends to shared actors: an
        # end is a dead stage. Leave the process, so that Ray restarts the actor with a fresh one.
        error = None if task.cancelled() else task.exception()
        log.error("stage %s ended (%r); the actor exits to be restarted", self._stage_name, error)
        os._exit(1)

    async def deliver(self, data: bytes) -> None:
        """A batch of messages from a front end or another stage."""
        self._ensure_started()
        self._endpoint.accept(data)

    async def poll(self, front: str, hello: bool, wait: float) -> tuple[str, bytes]:
        """(incarnation, the messages for ``front``): see ``StageEndpoint.poll``."""
        self._ensure_started()
        return self._incarnation, await self._endpoint.poll(front, hello, wait)

    async def leave(self, front: str) -> None:
        self._endpoint.leave(front)

    async def describe(self) -> dict[str, Any]:
        """Where this stage runs and what it runs (front ends check ``digest`` against theirs)."""
        return {
            "stage": self._stage_name,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "incarnation": self._incarnation,
            "digest": self._digest,
        }
