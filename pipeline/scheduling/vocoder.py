"""The ``vocoder`` scheduler: streaming decode with per-request causal state.

A request's frames accumulate until a chunk is due (``first_chunk_frames`` for the first decode, so
that first audio does not wait for a whole chunk, then ``chunk_frames``); the end of the input
stream flushes whatever is pending with ``final=True``. Per-request state (the runner's causal state
and the pending frames) lives from the first frame to the final decode, a failure or an abort.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pipeline.proto import StagePayload
from pipeline.scheduling.base import (
    NoConversations,
    RequestFailure,
    StageOutput,
    StepResult,
    VocoderRunner,
    describe_error,
)

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    state: Any
    pending: list[dict[str, Any]] = field(default_factory=list)
    decodes: int = 0
    closed: bool = False


class VocoderScheduler(NoConversations):
    def __init__(
        self, runner: VocoderRunner, max_batch: int, chunk_frames: int, first_chunk_frames: int
    ) -> None:
        self._runner = runner
        self._max_batch = max_batch
        self._chunk_frames = chunk_frames
        self._first_chunk_frames = first_chunk_frames
        self._streams: dict[str, _Stream] = {}

    def _stream(self, payload: StagePayload) -> _Stream:
        stream = self._streams.get(payload.request_id)
        if stream is None:
            stream = _Stream(self._runner.new_state(payload))
            self._streams[payload.request_id] = stream
        return stream

    def add(self, payload: StagePayload) -> None:
        stream = self._stream(payload)
        stream.pending.append(payload.data)
        stream.closed = True

    def feed(self, payload: StagePayload) -> None:
        self._stream(payload).pending.append(payload.data)

    def close_stream(self, payload: StagePayload) -> None:
        stream = self._stream(payload)
        if payload.data:
            stream.pending.append(payload.data)
        stream.closed = True

    def abort(self, request_id: str) -> None:
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        """Free a request's causal state: its final decode ran, it failed, or it was aborted."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._runner.release(stream.state)

    def _due(self, stream: _Stream) -> int:
        return self._first_chunk_frames if stream.decodes == 0 else self._chunk_frames

    def _ready(self, stream: _Stream) -> bool:
        return stream.closed or len(stream.pending) >= self._due(stream)

    def has_work(self) -> bool:
        return any(self._ready(s) for s in self._streams.values())

    def step(self) -> list[StepResult]:
        ready = [(rid, s) for rid, s in self._streams.items() if self._ready(s)][: self._max_batch]
        outputs: list[StepResult] = []
        for rid, stream in ready:
            due = self._due(stream)
            chunk, stream.pending = stream.pending[:due], stream.pending[due:]
            final = stream.closed and not stream.pending
            try:
                data = self._runner.decode(stream.state, chunk, final)
            except Exception as err:  # noqa: BLE001 - fails this request only
                log.warning("request %s failed: %s", rid, describe_error(err))
                self._release(rid)
                outputs.append(RequestFailure(rid, describe_error(err)))
                continue
            stream.decodes += 1
            outputs.append(StageOutput(rid, data, final=final))
            if final:
                self._release(rid)
        return outputs

    def live_requests(self) -> int:
        return len(self._streams)

    def queue_depth(self) -> int:
        return sum(len(s.pending) for s in self._streams.values())
