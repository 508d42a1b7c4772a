"""A stage: the IO shell around one scheduler. It knows no model and no scheduler type.

Two threads of control, each owning its own state:
- the event loop (``run``) owns the control plane: it receives messages, merges fan-in, routes
  outputs to ``next``/``stream_to`` targets and to the coordinator, and keeps ``_active`` (the
  params and stream sequence numbers of each request in this stage) and ``_gone`` (requests that
  were aborted, failed or finished here, whose late data is dropped and never recreates state);
- one worker thread owns the scheduler: it applies the commands the loop queues, in order, and
  steps the scheduler while it has work. Compute never runs on the event loop. It keeps its own
  ``_ended`` (requests the scheduler finished or failed): commands the loop queued for them before
  it learned of the end are skipped, so they cannot recreate state that nothing would release.

An abort is applied on the loop at once (the request is marked gone, its fan-in buffer freed) and
then in the worker, between two steps; the AbortAck leaves only after the scheduler released its
state (at once when the stage holds nothing of the request). Per-request entries of ``_active`` live from a request's first message to its final output,
failure or abort.

Kept conversation state (a scheduler capability, see ``pipeline/scheduling/conversations.py``) is
the scheduler's, not the stage's: in a stage that keeps conversations, an Abort that names one
always goes to the worker (the request may have finished here and still own the kept state), and
DropConversation frees it; other stages treat such an Abort as any other.
The stage only reports its size per conversation in StageStats.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import StageConfig
from pipeline.proto import (
    COORDINATOR,
    Abort,
    AbortAck,
    ControlMessage,
    DropConversation,
    Failed,
    MergeFn,
    Ready,
    RecentIds,
    Shutdown,
    StageCrashed,
    StagePayload,
    StageStats,
    StatsRequest,
    StreamChunk,
    StreamDone,
    Submit,
)
from pipeline.scheduling.base import (
    RequestFailure,
    Scheduler,
    StageOutput,
    StepResult,
    conversation_keeper,
    describe_error,
)
from pipeline.transport.base import Endpoint

log = logging.getLogger(__name__)

GONE_MEMORY = 65536
"""How many ended request ids a stage remembers, to drop their late data."""

STATS_INTERVAL_S = 0.2


_Counts = tuple[int, int, dict[str, int]]
"""What the worker reports after a command or step: live requests, queue depth, kept sizes."""


@dataclass
class _Request:
    params: dict[str, Any]
    seq: int = 0
    fan_in: dict[str, StagePayload] = field(default_factory=dict)


@dataclass
class _Command:
    request_id: str | None
    run: Callable[[], None]


class Stage:
    def __init__(
        self,
        config: StageConfig,
        scheduler: Scheduler,
        endpoint: Endpoint,
        merge: MergeFn | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self._scheduler = scheduler
        self._keeper = conversation_keeper(scheduler)
        self._keeps = self._keeper is not None and self._keeper.keeps_conversations
        self._endpoint = endpoint
        self._merge = merge
        self._active: dict[str, _Request] = {}
        self._gone = RecentIds(GONE_MEMORY)
        self._ended = RecentIds(GONE_MEMORY)
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduler_live = 0
        self._scheduler_depth = 0
        self._conversation_sizes: dict[str, int] = {}
        self._step_seconds: list[float] = []
        self._last_stats: tuple[int, int, int, int, int] | None = None

    # --- event loop side ------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until Shutdown; then stop the worker and close the endpoint."""
        self._loop = asyncio.get_running_loop()
        worker = threading.Thread(target=self._work, name=f"stage-{self.name}", daemon=True)
        worker.start()
        stats = asyncio.create_task(self._report_stats())
        self._endpoint.send(COORDINATOR, Ready(self.name, self._keeps))
        try:
            while True:
                message = await self._endpoint.recv()
                if isinstance(message, Shutdown):
                    break
                self._handle(message)
        finally:
            stats.cancel()
            self._commands.put(None)
            await asyncio.to_thread(worker.join)
            self._endpoint.close()

    def _handle(self, message: ControlMessage) -> None:
        match message:
            case Submit(payload=payload, source=source):
                self._on_submit(payload, source)
            case StreamChunk(payload=payload):
                if self._admit(payload):
                    self._queue(payload.request_id, lambda: self._scheduler.feed(payload))
            case StreamDone(payload=payload):
                if self._admit(payload):
                    self._queue(payload.request_id, lambda: self._scheduler.close_stream(payload))
            case Abort(request_id=rid, conversation_id=str() as cid, keep_answer_tokens=keep) if (
                self._keeps
            ):
                self._forget(rid)
                self._queue(None, lambda: self._abort_in_worker(rid, (cid, keep)))
            case Abort(request_id=rid):
                held = rid in self._active
                self._forget(rid)
                if held:
                    self._queue(None, lambda: self._abort_in_worker(rid))
                else:
                    # Never here, or already ended here: the scheduler released it before its final
                    # output or failure, and the worker skips whatever is still queued for it
                    # (``_ended``). No need to wait for the step in progress to acknowledge.
                    self._endpoint.send(COORDINATOR, AbortAck(rid, self.name))
            case DropConversation(conversation_id=cid, request_id=rid):
                self._queue(None, lambda: self._drop_in_worker(cid, rid))
            case StatsRequest(token=token):
                self._queue(None, lambda: self._post_counts(token))
            case _:
                log.error("stage %s: unexpected message %s", self.name, type(message).__name__)

    def _admit(self, payload: StagePayload) -> bool:
        """Whether data for this request may be processed; starts its bookkeeping if new."""
        rid = payload.request_id
        if rid in self._gone:
            log.debug("stage %s: dropped late data for %s", self.name, rid)
            return False
        if rid not in self._active:
            self._active[rid] = _Request(payload.params)
        return True

    def _on_submit(self, payload: StagePayload, source: str) -> None:
        if not self._admit(payload):
            return
        rid = payload.request_id
        if self.config.wait_for:
            entry = self._active[rid]
            entry.fan_in[source] = payload
            if set(entry.fan_in) != set(self.config.wait_for):
                return
            parts, entry.fan_in = entry.fan_in, {}
            try:
                payload = self._merge(parts) if self._merge else parts[self.config.wait_for[0]]
            except Exception as err:  # noqa: BLE001 - a merge that fails fails its request only
                log.warning("stage %s: request %s: merge failed: %s", self.name, rid, err)
                self._fail(rid, describe_error(err))
                return
        self._queue(rid, lambda: self._scheduler.add(payload))

    def _fail(self, rid: str, error: str) -> None:
        self._endpoint.send(COORDINATOR, Failed(rid, self.name, error))
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._active.pop(rid, None)
        self._gone.add(rid)

    def _queue(self, rid: str | None, run: Callable[[], None]) -> None:
        self._commands.put(_Command(rid, run))

    def _on_worker(
        self, results: list[StepResult], counts: _Counts, step_s: float | None, token: int | None
    ) -> None:
        self._scheduler_live, self._scheduler_depth, self._conversation_sizes = counts
        if step_s is not None:
            self._step_seconds.append(step_s)
        for result in results:
            rid = result.request_id
            if rid in self._gone or rid not in self._active:
                continue
            if isinstance(result, RequestFailure):
                self._fail(rid, result.error)
            else:
                self._route(result)
        if token is not None:
            self._send_stats(token)

    def _on_abort_done(self, rid: str, counts: _Counts, kept_by: str | None = None) -> None:
        self._scheduler_live, self._scheduler_depth, self._conversation_sizes = counts
        self._endpoint.send(COORDINATOR, AbortAck(rid, self.name, kept_by))

    def _on_worker_died(self, error: str) -> None:
        # Nothing would ever compute or acknowledge again here: a crash the coordinator reports
        # (every request fails, new ones are refused) instead of requests that hang.
        self._endpoint.send(COORDINATOR, StageCrashed(self.name, f"worker failed: {error}"))

    def _route(self, output: StageOutput) -> None:
        entry = self._active[output.request_id]
        payload = StagePayload(output.request_id, output.data, entry.params)
        seq = entry.seq
        entry.seq += 1
        stream_targets = list(self.config.stream_to)
        if self.config.terminal:
            stream_targets.append(COORDINATOR)
        if not output.final:
            for target in stream_targets:
                self._endpoint.send(target, StreamChunk(payload, self.name, seq))
            return
        for target in stream_targets:
            self._endpoint.send(target, StreamDone(payload, self.name, seq))
        for target in self.config.next:
            self._endpoint.send(target, Submit(payload, self.name))
        self._forget(output.request_id)

    def _stats(self, token: int | None) -> StageStats:
        return StageStats(
            source=self.name,
            live_requests=max(len(self._active), self._scheduler_live),
            queue_depth=self._scheduler_depth + self._commands.qsize(),
            shm_bytes=self._endpoint.shm_bytes(),
            step_seconds=self._step_seconds,
            token=token,
            conversations=dict(self._conversation_sizes),
        )

    def _send_stats(self, token: int | None) -> None:
        stats = self._stats(token)
        self._step_seconds = []
        self._last_stats = self._summary(stats)
        self._endpoint.send(COORDINATOR, stats)

    @staticmethod
    def _summary(stats: StageStats) -> tuple[int, int, int, int, int]:
        """What a periodic report is sent for when it changed."""
        kept = stats.conversations
        return (stats.live_requests, stats.queue_depth, stats.shm_bytes, len(kept), sum(kept.values()))

    async def _report_stats(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            stats = self._stats(None)
            current = self._summary(stats)
            if stats.step_seconds or current != self._last_stats:
                self._send_stats(None)

    # --- worker thread side ---------------------------------------------------------------

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(callback, *args)

    def _counts(self) -> _Counts:
        return (
            self._scheduler.live_requests(),
            self._scheduler.queue_depth(),
            self._keeper.conversation_sizes() if self._keeper is not None else {},
        )

    def _abort_in_worker(self, rid: str, conversation: tuple[str, int | None] | None = None) -> None:
        kept_by = None
        try:
            if conversation is None or self._keeper is None:
                self._scheduler.abort(rid)
            else:
                kept_by = self._keeper.abort_conversation(rid, *conversation)
        finally:
            # Schedulers drop a request's entry before releasing it, so even a release that raised
            # left nothing to serve: acknowledge either way, or the abort would wait for nothing.
            self._post(self._on_abort_done, rid, self._counts(), kept_by)

    def _drop_in_worker(self, cid: str, rid: str | None) -> None:
        if self._keeper is not None:
            self._keeper.drop_conversation(cid, rid)
        self._post(self._on_worker, [], self._counts(), None, None)

    def _post_counts(self, token: int) -> None:
        self._post(self._on_worker, [], self._counts(), None, token)

    def _work(self) -> None:
        try:
            self._serve_commands()
        except Exception as err:  # noqa: BLE001 - a scheduler bug: reported, not a silent hang
            log.exception("stage %s: worker failed", self.name)
            self._post(self._on_worker_died, describe_error(err))

    def _serve_commands(self) -> None:
        while True:
            commands = [self._commands.get()] if not self._scheduler.has_work() else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            failures: list[StepResult] = []
            for command in commands:
                if command is None:
                    return
                if command.request_id in self._ended:
                    continue  # queued before the loop learned that the scheduler ended it
                try:
                    command.run()
                except Exception as err:  # noqa: BLE001 - a bad input fails its request only
                    if command.request_id is None:
                        log.exception("stage %s: command failed", self.name)
                        continue
                    log.warning("stage %s: request %s failed: %s", self.name, command.request_id, err)
                    self._scheduler.abort(command.request_id)
                    self._ended.add(command.request_id)
                    failures.append(RequestFailure(command.request_id, describe_error(err)))
            if failures:
                self._post(self._on_worker, failures, self._counts(), None, None)
            if self._scheduler.has_work():
                started = time.perf_counter()
                results = self._scheduler.step()
                elapsed = time.perf_counter() - started
                for result in results:
                    if isinstance(result, RequestFailure) or result.final:
                        self._ended.add(result.request_id)
                self._post(self._on_worker, results, self._counts(), elapsed, None)
