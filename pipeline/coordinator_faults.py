"""What the coordinator does when something breaks, so that a fault leaves nothing behind.

- A stage fails a request (``Failed``, e.g. an output it could not send): the response fails and
  the request is aborted everywhere, since other stages may hold it (a fan-in buffer, a talker
  waiting for text).
- A stage crashes (its process died, its worker thread or socket reader died): every response in
  flight fails and is cleared from the surviving stages; new requests are refused until the
  restarted stage is Ready, and it is told to forget the requests the crash failed.
- A stage hangs (its worker blocked in a step, its event loop or socket reader stuck): it cannot
  say so, so the coordinator asks every serving stage for a sign of life every
  ``hang_timeout_s / 4`` (``StatsRequest(fresh=False)``: the socket reader and the event loop
  take part in every answer; the worker either answers itself between two steps, or has used
  CPU time since the previous question, so that a long step that computes, a big prefill on a
  slow machine, is not taken for a hang), and a stage that has not answered within
  ``hang_timeout_s`` is handled as crashed, then stopped (``kill_hook``: its process is killed)
  so that it is started again. Without this a hung stage would fail every request it gets by the
  stream idle timeout, for good.
- A control message cannot be queued (``SendError``): logged; what it would have caused ends by
  its own timeout (an abort, a stats question).
- The coordinator's own socket reader dies: messages may be lost (chunks, acks), so every response
  in flight fails and is cleared everywhere, and the pipeline reports it (``failure``, /healthz)
  until every stage was heard through the new reader.

A mixin of ``Coordinator``, typed against ``CoordinatorCore`` (what it needs of it, so that the
two modules do not import each other): it works on the coordinator's state, on its event loop.
Per-fault state: ``_crashed`` (stage -> why, until it is Ready again), ``_casualties`` (requests
a crash failed, until no stage is down), ``_deaf`` (why the reader died, until the stages were
heard).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from pipeline.config import PipelineConfig
from pipeline.coordinator_stats import StatsQuestions
from pipeline.flights import Flight, PendingAbort, PipelineError
from pipeline.proto import Abort, ControlMessage, RecentIds, StageStats
from pipeline.scheduling.conversation_keeping import ConversationKeeping
from pipeline.transport.base import Endpoint, send_control

log = logging.getLogger(__name__)


class CoordinatorCore(Protocol):
    """What the fault handling needs of the coordinator it is mixed into (its state and its
    request lifecycle), so that this module does not import ``pipeline.coordinator``."""

    config: PipelineConfig
    conversations: ConversationKeeping
    kill_hook: Callable[[str, str], None] | None
    _endpoint: Endpoint
    _flights: dict[str, Flight]
    _aborts: dict[str, PendingAbort]
    _ended: RecentIds
    _ready_stages: set[str]
    _all_ready: asyncio.Event
    _broken: PipelineError | None
    _questions: StatsQuestions
    _crashed: dict[str, str]
    _casualties: set[str]
    _deaf: str | None
    _background: set[asyncio.Task[None]]
    _closed: bool

    def abort(self, request_id: str, keep_answer_tokens: int | None = None) -> Awaitable[None]: ...
    def stage_stats(self, timeout: float = 5.0) -> Awaitable[dict[str, StageStats]]: ...
    def _broadcast_abort(
        self, request_id: str, conversation: tuple[str, int | None] | None = None
    ) -> PendingAbort: ...
    def _on_ack(self, rid: str, source: str) -> None: ...
    def _dead_stages(self) -> set[str]: ...
    def _send(self, target: str, message: ControlMessage) -> bool: ...
    def _in_background(self, work: Coroutine[Any, Any, None]) -> None: ...
    def _abort_everywhere(self, rid: str) -> None: ...
    def _fail_flight(self, rid: str, flight: Flight, error: PipelineError) -> None: ...
    def on_stage_crashed(self, stage: str, error: str) -> None: ...
    def _serve_if_whole(self) -> None: ...
    def _on_hung(self, stage: str) -> None: ...


class CoordinatorFaults:
    def _send(self: CoordinatorCore, target: str, message: ControlMessage) -> bool:
        """Send a control message; False (and a log line) when it could not be queued."""
        return send_control(self._endpoint, target, message, "coordinator")

    def _in_background(self: CoordinatorCore, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_failed(self: CoordinatorCore, rid: str, source: str, error: str) -> None:
        flight = self._flights.get(rid)
        log.warning("request %s failed in stage %s: %s", rid, source, error)
        if flight is None and rid in self._ended:
            return  # already aborted everywhere
        if flight is not None:
            flight.fail(PipelineError(source, error))
        self.conversations.end(rid, "failed", None)
        self._abort_everywhere(rid)

    def _abort_everywhere(self: CoordinatorCore, rid: str) -> None:
        """Clear a failed request from every live stage, like an abort (the others may still hold
        it: a fan-in buffer, a talker waiting for text, would wait forever), and await the acks in
        the background. Broadcast now, not in the task: the stream may end first and its ended id
        would make a later abort() a no-op."""
        if rid not in self._aborts:
            self._broadcast_abort(rid)
        self._in_background(self.abort(rid))

    def _fail_flight(self: CoordinatorCore, rid: str, flight: Flight, error: PipelineError) -> None:
        failed = flight.fail(error)
        self.conversations.end(rid, "failed", None)
        if failed:
            self._abort_everywhere(rid)  # the stages that still work may hold it

    def on_stage_crashed(self: CoordinatorCore, stage: str, error: str) -> None:
        """A stage is gone: fail everything in flight (and clear it from the surviving stages),
        refuse new requests, stop waiting for it.

        The runner may restart the stage; its Ready then heals the pipeline (``_on_recovered``).
        """
        log.error("stage %s crashed: %s", stage, error)
        self._crashed[stage] = error
        self._ready_stages.discard(stage)
        if self._broken is None:
            self._broken = PipelineError(stage, f"stage crashed: {error}")
        self.conversations.on_crash(stage)
        for rid, flight in list(self._flights.items()):
            self._casualties.add(rid)
            self._fail_flight(rid, flight, self._broken)
        for rid in list(self._aborts):
            self._on_ack(rid, stage)
        self._questions.forget(stage)
        self._all_ready.set()

    def _on_recovered(self: CoordinatorCore, stage: str) -> None:
        """A restarted stage is Ready: serve again once no stage is down.

        Messages for requests the crash failed may still reach the new process (ZMQ re-delivers
        what it queued for the dead one), so it is told to forget every one of them.
        """
        log.warning("stage %s is back", stage)
        del self._crashed[stage]
        for rid in self._casualties:
            self._send(stage, Abort(rid))
        if not self._crashed:
            self._casualties.clear()
        self._serve_if_whole()

    def _serve_if_whole(self: CoordinatorCore) -> None:
        """Serve again when no stage is down and the reader hears; else say what still is wrong."""
        if self._closed or self._deaf is not None:
            return
        if self._crashed:
            stage, error = next(iter(self._crashed.items()))
            self._broken = PipelineError(stage, f"stage crashed: {error}")
        else:
            self._broken = None

    def _on_reader_died(self: CoordinatorCore, err: Exception) -> None:
        """Messages to the coordinator may have been lost: no response in flight can be trusted
        to end, so each fails and is cleared everywhere; the aborts awaiting acks are sent again
        (aborts are idempotent), and the pipeline refuses requests until it hears every stage."""
        self._deaf = f"the coordinator's socket reader failed: {err}"
        log.error("%s; failing %d requests in flight", self._deaf, len(self._flights))
        if self._broken is None:
            self._broken = PipelineError("pipeline", self._deaf)
        for rid, flight in list(self._flights.items()):
            self._fail_flight(rid, flight, PipelineError("pipeline", self._deaf))
        for rid, pending in self._aborts.items():
            for stage in pending.pending:
                self._send(stage, pending.message)

    async def _watch_stages(self: CoordinatorCore) -> None:
        """Find the stages that hang (see module doc); runs from ``start`` to ``close``."""
        timeout = self.config.hang_timeout_s
        while not self._closed:
            await asyncio.sleep(timeout / 4)
            if self._deaf is not None:
                continue  # nothing is heard now: the reader's own recovery asks every stage
            serving = self._ready_stages - self._dead_stages()
            asked, silent = await self._questions.ask(serving, timeout, fresh=False)
            if self._closed or self._deaf is not None:
                continue  # the answers may have been lost with the reader
            # A question that could not even be queued counts too: the stage does not read.
            for stage in sorted((silent | (serving - asked)) - self._dead_stages()):
                self._on_hung(stage)

    def _on_hung(self: CoordinatorCore, stage: str) -> None:
        why = (f"no answer for {self.config.hang_timeout_s:g} s: its worker, event loop or socket "
               "reader hangs")
        self.on_stage_crashed(stage, why)
        if self.kill_hook is not None:
            self.kill_hook(stage, why)

    async def _hear_again(self: CoordinatorCore) -> None:
        """After a new reader started: serve again once every live stage answered through it."""
        while not self._closed:
            try:
                await self.stage_stats()
            except TimeoutError:
                log.error("coordinator: stages not heard since the reader restarted; asking again")
                continue
            log.warning("coordinator: the socket reader hears every stage again")
            self._deaf = None
            self._serve_if_whole()
            return
