"""PipelineConfig / StageConfig: which stages, how they connect, where they run, and their limits.

Loaded from the ``pipeline`` section of a preset (``configs/*.yaml``) and validated at load: a wrong
config fails with a message that names the field. The config is immutable once loaded and is shared
by the coordinator, the runner and every stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SchedulerKind = Literal["simple", "ar", "vocoder"]
Placement = Literal["local", "ray"]
PlacementGroupStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class ConfigError(ValueError):
    """A preset or pipeline config is invalid; the message names the field."""


class StageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    runner: str = Field(description="stage factory name in the model package's registry entry")
    scheduler: SchedulerKind
    next: list[str] = Field(default_factory=list, description="stages that get the final payload")
    stream_to: list[str] = Field(default_factory=list, description="stages that get each chunk")
    wait_for: list[str] = Field(default_factory=list, description="fan-in: sources to wait for")
    merge: str | None = Field(default=None, description="fan-in merge function name")
    terminal: bool = False
    process: str = Field(default="main", description="process group; one OS process per group")
    device: str = "cpu"
    threads: int = Field(default=1, ge=1, description="torch threads of this stage's process")
    max_batch: int = Field(default=8, ge=1)
    max_new_tokens: int | None = Field(default=None, ge=1, description="ar: output cap per request")
    cap_param: str | None = Field(
        default=None, description="ar: request param that may lower max_new_tokens"
    )
    chunk_frames: int = Field(default=4, ge=1, description="vocoder: frames per decode")
    first_chunk_frames: int = Field(default=1, ge=1, description="vocoder: frames of the 1st decode")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to the factory")
    # Ray placement only (``placement: ray``): what the stage's actor asks the cluster for.
    num_cpus: float = Field(default=1.0, ge=0, description="ray: CPUs reserved for the actor")
    num_gpus: float = Field(default=0.0, ge=0, description="ray: GPUs reserved for the actor")
    resources: dict[str, float] = Field(
        default_factory=dict, description="ray: custom resources of the actor (e.g. a node label)"
    )

    @model_validator(mode="after")
    def _check_kind(self) -> StageConfig:
        if self.scheduler == "ar" and self.max_new_tokens is None:
            raise ValueError(f"stage {self.name!r}: an ar stage needs max_new_tokens (output cap)")
        if self.wait_for and not self.merge and len(self.wait_for) > 1:
            raise ValueError(f"stage {self.name!r}: wait_for with several sources needs merge")
        return self


class PipelineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="model package under pipeline/models (or a registered test model)")
    model_args: dict[str, Any] = Field(default_factory=dict)
    entry: str
    stages: list[StageConfig] = Field(min_length=1)
    max_in_flight: int = Field(default=16, ge=1)
    owner_share: int | None = Field(
        default=None, ge=1,
        description="requests one owner (a session, an API client) may hold however full the "
        "pipeline is; beyond it an owner's requests may not take the last owner_share slots "
        "(default max(1, max_in_flight // 4); see pipeline/admission.py)",
    )
    abort_timeout_s: float = Field(default=5.0, gt=0)
    stream_idle_timeout_s: float = Field(
        default=60.0, gt=0,
        description="a request that yields nothing for this long fails (a stalled stage) and is "
        "aborted everywhere: no client waits forever and no stage keeps its state",
    )
    restart_delay_s: float = Field(
        default=0.5, gt=0, description="first delay before a dead stage process is started again"
    )
    hang_timeout_s: float = Field(
        default=30.0, gt=0,
        description="a stage that does not answer the coordinator's periodic sign-of-life "
        "question (its socket reader and event loop answer, when its worker thread used CPU time "
        "since the last question or is free to answer itself) for this long hangs: it is handled "
        "as crashed, and its process killed and started again. A step that computes for longer "
        "is not a hang; one that only waits (a lock, a blocking read) for longer is",
    )
    # Below ~64 KiB a copy through the ZMQ socket is cheaper than a segment (create, write, read,
    # unlink and a release message): measured by evaluation/pipeline_overhead.py's payload rows.
    shm_threshold_bytes: int = Field(
        default=65536, ge=0, description="tensors at least this large ride shared memory"
    )

    placement: Placement = Field(
        default="local", description="local: in-process or stage processes; ray: one actor per stage"
    )
    ray_address: str | None = Field(
        default=None, description="ray: cluster to join ('auto', 'host:port'); None starts one here"
    )
    ray_namespace: str = Field(default="duplex", description="ray: namespace of the stage actors")
    ray_name: str | None = Field(
        default=None,
        description="ray: name prefix of the stage actors; front ends with the same prefix share "
        "them (default: derived from this config, so equal configs share)",
    )
    ray_placement_group: PlacementGroupStrategy | None = Field(
        default=None, description="ray: reserve one bundle per stage with this strategy"
    )
    ray_spread: bool = Field(
        default=False, description="ray: spread the stage actors over nodes (without a group)"
    )
    ray_max_restarts: int = Field(
        default=-1, ge=-1, description="ray: restarts of a dead stage actor (-1: without limit)"
    )

    @model_validator(mode="after")
    def _check_placement(self) -> PipelineConfig:
        if self.placement != "ray":
            return self
        if self.ray_placement_group is not None:
            for s in self.stages:
                # Ray refuses an empty bundle: each stage must reserve something.
                if not (s.num_cpus or s.num_gpus or any(s.resources.values())):
                    raise ValueError(
                        f"stages.{s.name}: with ray_placement_group a stage must reserve "
                        "num_cpus, num_gpus or resources"
                    )
        return self

    @model_validator(mode="after")
    def _check_graph(self) -> PipelineConfig:
        names = [s.name for s in self.stages]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"stages: duplicate stage names {sorted(dupes)}")
        known = set(names)
        if self.entry not in known:
            raise ValueError(f"entry: {self.entry!r} is not a stage (stages: {names})")
        for s in self.stages:
            for field_name in ("next", "stream_to", "wait_for"):
                for target in getattr(s, field_name):
                    if target not in known:
                        raise ValueError(
                            f"stages.{s.name}.{field_name}: {target!r} is not a stage"
                        )
                    if target == s.name:
                        raise ValueError(f"stages.{s.name}.{field_name}: a stage cannot feed itself")
        next_feeders: dict[str, set[str]] = {n: set() for n in names}
        stream_feeders: dict[str, set[str]] = {n: set() for n in names}
        for s in self.stages:
            for target in s.next:
                next_feeders[target].add(s.name)
            for target in s.stream_to:
                stream_feeders[target].add(s.name)
        for s in self.stages:
            feeders = next_feeders[s.name] | stream_feeders[s.name]
            if set(s.wait_for) != next_feeders[s.name] and (s.wait_for or len(next_feeders[s.name]) > 1):
                raise ValueError(
                    f"stages.{s.name}.wait_for: must list exactly the stages whose next is "
                    f"{s.name!r} ({sorted(next_feeders[s.name])}), got {sorted(s.wait_for)}"
                )
            if len(stream_feeders[s.name]) > 1:
                raise ValueError(
                    f"stages.{s.name}: streamed from several stages {sorted(stream_feeders[s.name])};"
                    " one stream source per stage"
                )
            if next_feeders[s.name] and stream_feeders[s.name]:
                raise ValueError(
                    f"stages.{s.name}: fed both by next and by stream_to; use one kind of edge"
                )
            if s.name != self.entry and not feeders:
                raise ValueError(f"stages.{s.name}: no stage feeds it and it is not the entry")
            if s.name == self.entry and feeders:
                raise ValueError(f"entry: {s.name!r} must not be fed by other stages")
            if not s.terminal and not (s.next or s.stream_to):
                raise ValueError(f"stages.{s.name}: neither terminal nor feeding any stage")
        if not any(s.terminal for s in self.stages):
            raise ValueError("stages: at least one stage must be terminal")
        self._check_acyclic(names)
        return self

    def _check_acyclic(self, names: list[str]) -> None:
        edges = {s.name: s.next + s.stream_to for s in self.stages}
        state: dict[str, int] = {}

        def visit(node: str, path: list[str]) -> None:
            if state.get(node) == 1:
                raise ValueError(f"stages: cycle {' -> '.join(path + [node])}")
            if state.get(node) == 2:
                return
            state[node] = 1
            for nxt in edges[node]:
                visit(nxt, path + [node])
            state[node] = 2

        for n in names:
            visit(n, [])

    def stage(self, name: str) -> StageConfig:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def terminals(self) -> list[str]:
        return [s.name for s in self.stages if s.terminal]

    @property
    def process_groups(self) -> dict[str, list[StageConfig]]:
        groups: dict[str, list[StageConfig]] = {}
        for s in self.stages:
            groups.setdefault(s.process, []).append(s)
        return groups


def _format_validation_error(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"{where}: {loc}: {e['msg']}")
    return "\n".join(lines)


def parse_pipeline_config(data: dict[str, Any], where: str = "pipeline") -> PipelineConfig:
    """Validate a ``pipeline`` section; raises ConfigError naming the bad field."""
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, where)) from None


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read preset: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a preset must be a mapping")
    return data
