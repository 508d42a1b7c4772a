"""A front end's supervision of the stage actors of one config on a Ray cluster.

Who starts, finds and restarts the stage actors:
- they are named, detached actors (``ray_actor.actor_name``), one per stage, created with
  ``get_if_exists``: the first front end (``duplex.serve`` process) that starts the config creates
  them, every later one finds the same actors, so all front ends submit to one scheduler per stage
  and its batches span them. They outlive front ends (the next one starts without loading models
  again) until ``remove_stages`` or the end of the cluster;
- Ray restarts an actor whose process or node died (``max_restarts``; a fresh Stage that holds
  nothing); no front end owns the actors, so no front end has to be alive for that;
- every front end watches every actor through its polls (``FrontEndpoint``): a failed poll or a
  new incarnation is a loss. ``RaySupervisor`` then fails what is in flight here
  (``Coordinator.on_stage_crashed``: clear errors, never a hang), aborts this front end's open
  requests on the other stages (so that no survivor keeps state for requests that cannot finish),
  and the stage's Ready, replayed when a poll reaches the restarted actor, heals the coordinator.

One RaySupervisor per front end, from ``start`` until the coordinator closes (``stop``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipeline.config import PipelineConfig, StageConfig
from pipeline.coordinator import Coordinator, PipelineError
from pipeline.placement.ray_actor import StageActor, actor_name, actor_prefix, config_digest
from pipeline.proto import Abort
from pipeline.transport.ray_endpoint import FrontEndpoint

log = logging.getLogger(__name__)

GROUP_READY_S = 60.0
LEAVE_TIMEOUT_S = 2.0
_RemoteStageActor = ray.remote(StageActor)


def connect(config: PipelineConfig) -> None:
    """Join the config's cluster (``ray_address``; None starts a local one), unless this process
    already did. No dashboard, no usage reports: nothing but the cluster's own traffic."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address=config.ray_address,
        namespace=config.ray_namespace,
        include_dashboard=False,
        configure_logging=False,
    )


def _bundle(stage: StageConfig) -> dict[str, float]:
    bundle = {"CPU": stage.num_cpus, "GPU": stage.num_gpus, **stage.resources}
    return {k: v for k, v in bundle.items() if v}


def _group_name(config: PipelineConfig) -> str:
    return f"{actor_prefix(config)}.group"


def _placement_group(config: PipelineConfig) -> Any:
    """The config's placement group (one bundle per stage), found by name or created detached:
    it holds the stage actors' resources for as long as they live, and goes with them
    (``remove_stages``; Ray would not restart an actor whose group is gone)."""
    assert config.ray_placement_group is not None
    try:
        group = get_placement_group(_group_name(config))
    except ValueError:  # none of that name yet
        group = placement_group(
            [_bundle(s) for s in config.stages],
            strategy=config.ray_placement_group,
            name=_group_name(config),
            lifetime="detached",
        )
    try:
        ray.get(group.ready(), timeout=GROUP_READY_S)
    except ray.exceptions.GetTimeoutError:
        raise PipelineError(
            "pipeline", f"placement group {_group_name(config)!r} not placed after {GROUP_READY_S:.0f}s"
            f" (bundles {[_bundle(s) for s in config.stages]}, {config.ray_placement_group})"
        ) from None
    return group


def find_or_create_stages(config: PipelineConfig) -> dict[str, Any]:
    """Every stage's actor handle (blocking: cluster calls). Creating an actor returns at once; the
    stage loads its model in the actor while the front end waits for its Ready."""
    connect(config)
    group = _placement_group(config) if config.ray_placement_group else None
    prefix = actor_prefix(config)
    handles: dict[str, Any] = {}
    for index, stage in enumerate(config.stages):
        options: dict[str, Any] = {
            "name": actor_name(prefix, stage.name),
            "namespace": config.ray_namespace,
            "lifetime": "detached",
            "get_if_exists": True,
            "max_restarts": config.ray_max_restarts,
            "max_task_retries": 0,  # a message to a dead stage is never replayed to its successor
            "num_cpus": stage.num_cpus,
            "num_gpus": stage.num_gpus,
            "resources": dict(stage.resources),
        }
        if group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index
            )
        elif config.ray_spread:
            options["scheduling_strategy"] = "SPREAD"
        handles[stage.name] = _RemoteStageActor.options(**options).remote(config, stage.name)
    return handles


async def describe_stages(config: PipelineConfig, timeout: float) -> dict[str, dict[str, Any]]:
    """Stage -> where its actor runs and what it runs (``StageActor.describe``), asked now."""
    prefix = actor_prefix(config)
    handles = [ray.get_actor(actor_name(prefix, s.name), namespace=config.ray_namespace)
               for s in config.stages]
    async with asyncio.timeout(timeout):
        info = await asyncio.gather(*(h.describe.remote() for h in handles))
    return {s.name: i for s, i in zip(config.stages, info, strict=True)}


def remove_stages(config: PipelineConfig) -> None:
    """Kill the config's stage actors (no restart) and remove its placement group, wherever they
    run: what an operator does to stop a shared set, and what tests do between clusters."""
    connect(config)
    prefix = actor_prefix(config)
    for stage in config.stages:
        try:
            ray.kill(ray.get_actor(actor_name(prefix, stage.name), namespace=config.ray_namespace))
        except ValueError:
            pass  # not running
    if config.ray_placement_group:
        try:
            remove_placement_group(get_placement_group(_group_name(config)))
        except ValueError:
            pass


class RaySupervisor:
    """See module doc. Owns this front end's FrontEndpoint (its polls and links)."""

    def __init__(self, config: PipelineConfig, handles: dict[str, Any]) -> None:
        self._config = config
        self._handles = handles
        self._coordinator: Coordinator | None = None
        self.endpoint = FrontEndpoint(handles, config.terminals, self._on_lost)
        self.placement: dict[str, dict[str, Any]] = {}
        """Stage -> where its actor runs (``StageActor.describe``), as of the last ``describe``."""

    def start(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self.endpoint.start()

    async def describe(self, timeout: float) -> dict[str, dict[str, Any]]:
        """Ask every stage actor where it runs; refuses actors of a different config (an explicit
        ``ray_name`` reused for another config)."""
        async with asyncio.timeout(timeout):
            answers = await asyncio.gather(*(h.describe.remote() for h in self._handles.values()))
        info = dict(zip(self._handles, answers, strict=True))
        digest = config_digest(self._config)
        for stage, found in info.items():
            if found["digest"] != digest:
                raise PipelineError(
                    stage, f"actor {actor_name(actor_prefix(self._config), stage)!r} runs another "
                    "config; choose another ray_name or remove_stages() first",
                )
        self.placement = info
        if self._coordinator is not None:
            # Pids on the actors' own nodes, as of this answer (a restart brings a new one).
            self._coordinator.stage_pids.update({s: i["pid"] for s, i in info.items()})
        return info

    def _on_lost(self, stage: str, why: str) -> None:
        assert self._coordinator is not None
        self._coordinator.on_stage_crashed(stage, why)
        # The survivors may hold what the lost stage's requests left with them (a talker waiting
        # for tokens that will never come): clear them like an abort. Their acks find no waiter.
        for rid in self.endpoint.open_requests():
            for other in self._handles:
                if other != stage:
                    self.endpoint.send(other, Abort(rid))
            self.endpoint.forget(rid)

    async def stop(self) -> None:
        """Leave the stage actors (they keep serving other front ends). Actors that reported a
        crash are removed, so that the next front end starts them afresh."""
        try:
            await self.endpoint.leave(LEAVE_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as err:
            log.warning("leaving the stage actors: %r", err)
        self.endpoint.close()
        for stage in self.endpoint.crashed:
            log.warning("removing stage actor %s, which crashed", stage)
            ray.kill(self._handles[stage])
