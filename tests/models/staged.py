"""A preset's stages with their real runners and schedulers, stepped by hand in one thread.

The edges are the preset's (``next``, ``stream_to``, fan-in with its merge), but there is no stage
IO and no event loop: a test decides which requests are in flight together, so the thinker and
the talker provably step them as one batch (the batch sizes each runner saw are recorded).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.config import PipelineConfig
from pipeline.models import StageContext, get_model
from pipeline.proto import OmniRequest, StagePayload
from pipeline.scheduling import build_scheduler
from pipeline.scheduling.base import RequestFailure, Scheduler


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    frames: list[Any] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    chunk_samples: list[int] = field(default_factory=list)
    finals: set[str] = field(default_factory=set)
    error: str | None = None


class Staged:
    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        spec = get_model(config.model)
        self.merges = spec.merges
        self.runners: dict[str, Any] = {}
        self.schedulers: dict[str, Scheduler] = {}
        self.batch_sizes: dict[str, list[int]] = defaultdict(list)
        for stage in config.stages:
            runner = spec.factories[stage.runner](StageContext(stage, config.model_args))
            self._record_batches(stage.name, runner)
            self.runners[stage.name] = runner
            self.schedulers[stage.name] = build_scheduler(stage, runner)
        self.results: dict[str, Result] = {}
        self.params: dict[str, dict[str, Any]] = {}
        self._fan_in: dict[tuple[str, str], dict[str, StagePayload]] = defaultdict(dict)
        self._gone: set[tuple[str, str]] = set()

    def _record_batches(self, name: str, runner: Any) -> None:
        step = getattr(runner, "step", None)
        if step is None:
            return

        def recording(slots: list[Any]) -> Any:
            self.batch_sizes[name].append(len(slots))
            return step(slots)

        runner.step = recording

    def submit(self, request: OmniRequest) -> None:
        self.results[request.request_id] = Result()
        self.params[request.request_id] = request.params
        payload = StagePayload(request.request_id, request.inputs, request.params)
        self._send(self.config.entry, "coordinator", payload, add=True)

    def run(self) -> dict[str, Result]:
        """Step until no stage has work."""
        while self.step():
            pass
        return self.results

    def step(self) -> bool:
        """One step of every stage with work, in graph order; False when none had any."""
        busy = [s.name for s in self.config.stages if self.schedulers[s.name].has_work()]
        for name in busy:
            for out in self.schedulers[name].step():
                self._route(name, out)
        return bool(busy)

    def abort(self, request_id: str) -> None:
        """What an Abort does in every stage: release, and drop the request's later data."""
        for stage in self.config.stages:
            self._gone.add((stage.name, request_id))
            self.schedulers[stage.name].abort(request_id)

    def _send(self, target: str, source: str, payload: StagePayload, add: bool = False,
              final: bool = False) -> None:
        stage = self.config.stage(target)
        scheduler = self.schedulers[target]
        if (target, payload.request_id) in self._gone:
            return
        if not add:
            (scheduler.close_stream if final else scheduler.feed)(payload)
        elif stage.wait_for:
            parts = self._fan_in[(target, payload.request_id)]
            parts[source] = payload
            if set(parts) == set(stage.wait_for):
                del self._fan_in[(target, payload.request_id)]
                scheduler.add(self.merges[stage.merge](parts) if stage.merge else payload)
        else:
            scheduler.add(payload)

    def _route(self, name: str, out: Any) -> None:
        result = self.results[out.request_id]
        if isinstance(out, RequestFailure):
            result.error = f"{name}: {out.error}"
            self.abort(out.request_id)
            return
        stage = self.config.stage(name)
        payload = StagePayload(out.request_id, out.data, self.params[out.request_id])
        for target in stage.stream_to:
            self._send(target, name, payload, final=out.final)
        if out.final:
            for target in stage.next:
                self._send(target, name, payload, add=True)
            self._gone.add((name, out.request_id))
        if name == "talker" and "codes" in out.data:
            result.frames.append(out.data["codes"])
        if stage.terminal:
            result.token_ids += out.data.get("token_ids", [])
            result.text += out.data.get("text", "")
            if "audio" in out.data:
                result.audio.append(out.data["audio"])
                result.chunk_samples.append(len(out.data["audio"]))
            if out.final:
                result.finals.add(name)
