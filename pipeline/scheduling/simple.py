"""The ``simple`` scheduler: stateless compute over whatever is queued, in batches.

Per-request state: the queued items of a request and, for a streamed input, the fact that its stream
is open; both end with the request's final item, its failure or its abort.
"""

from __future__ import annotations

import logging
from collections import deque

from pipeline.proto import StagePayload
from pipeline.scheduling.base import (
    BatchItem,
    BatchRunner,
    NoConversations,
    RequestFailure,
    StageOutput,
    StepResult,
    describe_error,
)

log = logging.getLogger(__name__)


class SimpleScheduler(NoConversations):
    def __init__(self, runner: BatchRunner, max_batch: int) -> None:
        self._runner = runner
        self._max_batch = max_batch
        self._queue: deque[BatchItem] = deque()
        self._open_streams: set[str] = set()

    def add(self, payload: StagePayload) -> None:
        self._queue.append(BatchItem(payload, final=True))

    def feed(self, payload: StagePayload) -> None:
        self._open_streams.add(payload.request_id)
        self._queue.append(BatchItem(payload, final=False))

    def close_stream(self, payload: StagePayload) -> None:
        self._queue.append(BatchItem(payload, final=True))

    def abort(self, request_id: str) -> None:
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        """Drop a request's queued items and open stream: it failed or was aborted."""
        self._queue = deque(i for i in self._queue if i.payload.request_id != request_id)
        self._open_streams.discard(request_id)

    def has_work(self) -> bool:
        return bool(self._queue)

    def step(self) -> list[StepResult]:
        batch = [self._queue.popleft() for _ in range(min(self._max_batch, len(self._queue)))]
        try:
            outputs = self._runner.run(batch)
        except Exception:  # noqa: BLE001 - rerun one by one to fail only the culprit
            return self._run_one_by_one(batch)
        return [self._output(item, data) for item, data in zip(batch, outputs, strict=True)]

    def _run_one_by_one(self, batch: list[BatchItem]) -> list[StepResult]:
        results: list[StepResult] = []
        failed: set[str] = set()
        for item in batch:
            rid = item.payload.request_id
            if rid in failed:
                continue
            try:
                (data,) = self._runner.run([item])
            except Exception as err:  # noqa: BLE001 - reported as this request's failure
                failed.add(rid)
                self._release(rid)
                results.append(RequestFailure(rid, describe_error(err)))
                log.warning("request %s failed: %s", rid, describe_error(err))
                continue
            results.append(self._output(item, data))
        return results

    def _output(self, item: BatchItem, data: dict) -> StageOutput:
        if item.final:
            self._open_streams.discard(item.payload.request_id)
        return StageOutput(item.payload.request_id, data, final=item.final)

    def live_requests(self) -> int:
        return len({i.payload.request_id for i in self._queue} | self._open_streams)

    def queue_depth(self) -> int:
        return len(self._queue)

