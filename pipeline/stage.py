"""A stage: the IO shell around one scheduler. It knows no model and no scheduler type.

Two threads of control, each owning its own state:
- the event loop (``run``) owns the control plane: it receives messages, merges fan-in, routes
  outputs to ``next``/``stream_to`` targets and to the coordinator, and keeps ``_active`` (the
  params and stream sequence numbers of each request in this stage) and ``_gone`` (requests that
  were aborted, failed or finished here, whose late data is dropped and never recreates state);
- one worker thread (``pipeline/stage_worker.py``) owns the scheduler: it applies the commands
  the loop queues, in order, and steps the scheduler while it has work. Compute never runs on the
  event loop.

An abort is applied on the loop at once (the request is marked gone, its fan-in buffer freed) and
then in the worker, before any command queued ahead of it (the worker's urgent lane, as aborts have
one in the endpoint's inbox) and between two steps; the AbortAck leaves only after the scheduler
released its state (at once when the stage holds nothing of the request). Per-request entries of
``_active`` live from a request's first message to its final output, failure or abort.

Faults: an output that cannot be sent (SendError: a full /dev/shm, a target at its high-water mark)
fails its request only: the stage releases it as for an abort (``_releasing`` holds it until the
scheduler did) and tells the coordinator, which fails the response and clears the other stages.
A dead worker thread or socket reader ends ``run`` with ``failure`` set after a StageCrashed: the
stage cannot serve, and its process exits so that the supervisor starts it again.

Kept conversation state (a scheduler capability, see ``pipeline/scheduling/conversations.py``) is
the scheduler's, not the stage's: in a stage that keeps conversations, an Abort that names one
always goes to the worker (the request may have finished here and still own the kept state), and
DropConversation frees it; other stages treat such an Abort as any other.
The stage only reports its size per conversation in StageStats.
"""

from __future__ import annotations

import asyncio
import logging
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
from pipeline.stage_worker import Counts, StageWorker
from pipeline.transport.base import (
    LAST_WORDS_LINGER_MS,
    Endpoint,
    ReaderDied,
    SendError,
    send_control,
)

log = logging.getLogger(__name__)

GONE_MEMORY = 65536
"""How many ended request ids a stage remembers, to drop their late data."""

STATS_INTERVAL_S = 0.2


@dataclass
class _Request:
    params: dict[str, Any]
    seq: int = 0
    fan_in: dict[str, StagePayload] = field(default_factory=dict)


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
        self._caches = self._keeper is not None and self._keeper.caches_conversations
        self._endpoint = endpoint
        self._merge = merge
        self._active: dict[str, _Request] = {}
        self._gone = RecentIds(GONE_MEMORY)
        self._worker: StageWorker | None = None
        self._releasing: set[str] = set()
        self._serving: asyncio.Task[None] | None = None
        self.failure: str | None = None
        """Why the stage stopped serving on its own (worker or reader died), or None."""
        self._scheduler_live = 0
        self._scheduler_depth = 0
        self._conversation_sizes: dict[str, int] = {}
        self._step_seconds: list[float] = []
        self._last_stats: tuple[int, int, int, int, int] | None = None

    # --- event loop side ------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until Shutdown, or until the stage cannot serve (``failure``); then stop the
        worker and close the endpoint."""
        callbacks = (self._on_worker, self._on_abort_done, self._on_worker_died)
        self._worker = worker = StageWorker(
            self.name, self._scheduler, self._keeper, asyncio.get_running_loop(), callbacks
        )
        worker.start()
        stats = asyncio.create_task(self._report_stats())
        self._report(Ready(self.name, self._keeps, self._caches))
        self._serving = asyncio.create_task(self._serve_messages(), name=f"stage-{self.name}-loop")
        try:
            await self._serving
        except ReaderDied as err:
            self._die(str(err))
        except asyncio.CancelledError:
            if self.failure is None:  # cancelled from outside, not by _die
                raise
        finally:
            stats.cancel()
            await worker.stop()
            # A dead stage's StageCrashed must leave before its process exits.
            self._endpoint.close(linger_ms=LAST_WORDS_LINGER_MS if self.failure else 0)

    async def _serve_messages(self) -> None:
        while True:
            message = await self._endpoint.recv()
            if isinstance(message, Shutdown):
                return
            self._handle(message)

    def _die(self, reason: str) -> None:
        """Stop serving: nothing would compute, or nothing would be received, any more. A crash the
        coordinator reports (every request fails, new ones are refused until a restart) instead
        of requests that hang."""
        if self.failure is not None:
            return
        self.failure = reason
        log.error("stage %s cannot serve: %s", self.name, reason)
        self._report(StageCrashed(self.name, reason))
        if self._serving is not None:
            self._serving.cancel()

    def _report(self, message: ControlMessage) -> None:
        """Send a control message to the coordinator; one it cannot take is logged, not raised:
        what it waits for (an ack, a failure, stats) ends by its own timeouts then."""
        send_control(self._endpoint, COORDINATOR, message, f"stage {self.name}")

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
                self._work().abort(rid, (cid, keep))
            case Abort(request_id=rid):
                held = rid in self._active or rid in self._releasing
                self._forget(rid)
                if held:
                    self._work().abort(rid)
                else:
                    # Never here, or already ended here: the scheduler released it before its final
                    # output or failure, and the worker skips whatever is still queued for it
                    # (``_ended``). No need to wait for the step in progress to acknowledge.
                    self._report(AbortAck(rid, self.name))
            case DropConversation(conversation_id=cid, request_id=rid):
                self._work().drop_conversation(cid, rid)
            case StatsRequest(token=token, fresh=False) if self._work().progressed():
                self._send_stats(token)  # alive, in a long step: the counts can wait
            case StatsRequest(token=token):
                self._work().ask_counts(token)
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
        self._report(Failed(rid, self.name, error))
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._active.pop(rid, None)
        self._gone.add(rid)

    def _work(self) -> StageWorker:
        assert self._worker is not None, "messages are handled only while run() serves"
        return self._worker

    def _queue(self, rid: str | None, run: Callable[[], None]) -> None:
        self._work().queue(rid, run)

    def _on_worker(
        self, results: list[StepResult], counts: Counts, step_s: float | None, token: int | None
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

    def _on_abort_done(self, rid: str, counts: Counts, kept_by: str | None = None) -> None:
        self._scheduler_live, self._scheduler_depth, self._conversation_sizes = counts
        self._releasing.discard(rid)
        self._report(AbortAck(rid, self.name, kept_by))

    def _on_worker_died(self, error: str) -> None:
        self._die(f"worker failed: {error}")

    def _route(self, output: StageOutput) -> None:
        entry = self._active[output.request_id]
        payload = StagePayload(output.request_id, output.data, entry.params)
        seq = entry.seq
        entry.seq += 1
        stream_targets = list(self.config.stream_to)
        if self.config.terminal:
            stream_targets.append(COORDINATOR)
        try:
            if not output.final:
                for target in stream_targets:
                    self._endpoint.send(target, StreamChunk(payload, self.name, seq))
                return
            for target in stream_targets:
                self._endpoint.send(target, StreamDone(payload, self.name, seq))
            for target in self.config.next:
                self._endpoint.send(target, Submit(payload, self.name))
        except SendError as err:
            self._drop_unsendable(output.request_id, err)
            return
        self._forget(output.request_id)

    def _drop_unsendable(self, rid: str, err: SendError) -> None:
        """An output of ``rid`` could not be sent: the request cannot be answered. Release it here
        as an abort would (its ack tells the coordinator when the scheduler let go) and fail it;
        the coordinator's abort then clears what the targets that did get data hold."""
        log.error("stage %s: request %s failed: output not sent: %s", self.name, rid, err)
        self._forget(rid)
        self._releasing.add(rid)
        self._work().abort(rid)
        self._report(Failed(rid, self.name, f"could not send its output: {err}"))

    def _stats(self, token: int | None) -> StageStats:
        return StageStats(
            source=self.name,
            live_requests=max(len(self._active), self._scheduler_live),
            queue_depth=self._scheduler_depth + self._work().depth(),
            shm_bytes=self._endpoint.shm_bytes(),
            step_seconds=self._step_seconds,
            token=token,
            conversations=dict(self._conversation_sizes),
        )

    def _send_stats(self, token: int | None) -> None:
        stats = self._stats(token)
        self._step_seconds = []
        self._last_stats = self._summary(stats)
        self._report(stats)

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
