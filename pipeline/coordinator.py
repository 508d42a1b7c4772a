"""The coordinator: request lifecycle, entry, merge of terminal stages, abort broadcast and acks.

This is the pipeline's client API, and the only way ``duplex/`` reaches a model:
``stream(request)`` yields OutputChunks until every terminal stage completed, and ``abort(id)``
returns once every stage acknowledged that it holds nothing of the request.

Per-request state here: one ``Flight`` per request from ``stream`` until its last chunk, its failure
or its abort (bounded by ``max_in_flight`` and each owner's share: ``pipeline/admission.py``), and
one ``PendingAbort`` per abort until every stage acked.
Ended request ids are remembered (bounded) so that an aborted id can never be submitted again.

Conversations (the session's contract is in ``pipeline/scheduling/conversation_book.py``): a
request with ``params["conversation_id"]`` may continue the state that stages keep for its
conversation, so that only what is new is computed. Client API: ``abort(id, keep_answer_tokens=n)``
(barge-in, or a client's truncation once the answer ended: keep what was heard, also of a request
that already ended), ``withdraw(id)`` (as if never asked, also once ended), ``close_conversation``. The book of
conversations and its memory budget are owned here (``pipeline/scheduling/conversation_keeping.py``).

What happens when something breaks (a stage fails a request, crashes or hangs, a send cannot be
queued, the coordinator's own socket reader dies) is in ``pipeline/coordinator_faults.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

from pipeline import admission, metrics
from pipeline.config import PipelineConfig
from pipeline.coordinator_faults import CoordinatorFaults
from pipeline.coordinator_stats import StatsQuestions
from pipeline.flights import Flight, PendingAbort, PipelineError, PipelineOverloaded
from pipeline.proto import (
    COORDINATOR,
    Abort,
    AbortAck,
    ControlMessage,
    Failed,
    OmniRequest,
    OutputChunk,
    Ready,
    RecentIds,
    Shutdown,
    StageCrashed,
    StagePayload,
    StageStats,
    StreamChunk,
    StreamDone,
    Submit,
)
from pipeline.scheduling.conversation_keeping import ConversationKeeping
from pipeline.transport.base import Endpoint, SendError

log = logging.getLogger(__name__)

ENDED_MEMORY = 65536

__all__ = ["Coordinator", "PipelineError", "PipelineOverloaded"]


class Coordinator(CoordinatorFaults):
    """Owns the coordinator endpoint and the bookkeeping of every request in flight.

    ``shutdown_hook`` (set by the runner) stops stage processes or tasks when the coordinator closes.
    """

    def __init__(self, config: PipelineConfig, endpoint: Endpoint, output_sample_rate: int | None,
                 input_modalities: tuple[str, ...] = ("text", "audio")) -> None:
        self.config = config
        self.output_sample_rate = output_sample_rate
        self.input_modalities = input_modalities  # the model's (its ModelSpec's)
        self._endpoint = endpoint
        self._stages = [s.name for s in config.stages]
        self._flights: dict[str, Flight] = {}
        self._aborts: dict[str, PendingAbort] = {}
        self._ended = RecentIds(ENDED_MEMORY)
        self._ready_stages: set[str] = set()
        self._all_ready = asyncio.Event()
        self._broken: PipelineError | None = None
        self._questions = StatsQuestions(self._send, endpoint.shm_bytes)
        self._crashed: dict[str, str] = {}
        self._casualties: set[str] = set()  # requests a crash failed, until every stage is back
        self._deaf: str | None = None  # why the reader died, until every stage was heard again
        self._receiver: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        self.shutdown_hook: Callable[[], Awaitable[None]] | None = None
        self.kill_hook: Callable[[str, str], None] | None = None
        """(stage, why): stop a stage that hangs so that it is started again, as after a crash
        (set by the runner where it can: the supervisor kills the stage's process)."""
        self.stage_pids: dict[str, int] = {}
        """Stage name -> OS pid of its process (process mode only)."""
        self.conversations = ConversationKeeping(
            config, self._send, self._cut, self.abort, self.stage_stats, lambda rid: rid in self._aborts
        )
        """Kept conversation state: the book, its budget, the stages that keep it."""

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._receiver = asyncio.create_task(self._receive(), name="coordinator-receive")
        self._watcher = asyncio.create_task(self._watch_stages(), name="coordinator-watch")

    async def wait_ready(self, timeout: float) -> None:
        """Return once every stage is Ready; raise PipelineError if one crashed or time ran out."""
        ready = asyncio.create_task(self._all_ready.wait())
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout)
        except TimeoutError:
            missing = sorted(set(self._stages) - self._ready_stages)
            raise PipelineError("pipeline", f"stages not ready after {timeout:.0f}s: {missing}") from None
        finally:
            ready.cancel()
        if self._broken is not None:
            raise self._broken

    @property
    def ready(self) -> bool:
        return self._all_ready.is_set() and self._broken is None

    @property
    def keeps_conversations(self) -> bool:
        """Whether some stage keeps conversation state (``ModelPipeline.keeps_conversations``)."""
        return self.conversations.keeps_any()

    @property
    def failure(self) -> str | None:
        """Why the pipeline cannot serve any more (a stage crashed, it was closed), or None."""
        return None if self._broken is None else str(self._broken)

    async def close(self) -> None:
        self._closed = True
        self.conversations.stop()
        if self._broken is None:
            self._broken = PipelineError("pipeline", "the pipeline is closed")
        # Nobody will acknowledge anything any more: end every stream and every abort wait now.
        for flight in self._flights.values():
            if not flight.finished:
                flight.finished = True
                flight.chunks.put_nowait(PipelineError("pipeline", "shutting down"))
        for pending in self._aborts.values():
            pending.done.set()
        for stage in self._stages:
            self._send(stage, Shutdown())
        if self.shutdown_hook is not None:
            await self.shutdown_hook()
        for task in (self._receiver, self._watcher):
            if task is not None:
                task.cancel()
        self._endpoint.close()
        metrics.PIPELINE_SHM_BYTES.set(0)

    # --- client API -----------------------------------------------------------------------

    async def stream(self, request: OmniRequest) -> AsyncGenerator[OutputChunk, None]:
        """Submit ``request`` and yield its terminal stages' chunks in order.

        Ends when every terminal stage completed, or quietly when the request is aborted; raises
        PipelineError when a stage failed it, or when it yielded nothing for
        ``stream_idle_timeout_s`` (then it is aborted everywhere). Leaving the iteration early
        aborts the request.
        """
        rid = request.request_id
        if self._broken is not None:
            raise self._broken
        await self.conversations.prepare(request)
        if self._broken is not None:
            raise self._broken
        # An id whose abort is still being acknowledged counts as used: its Submit could reach a
        # stage after the Abort, be dropped as late data, and the stream would wait forever.
        if rid in self._flights or rid in self._ended or rid in self._aborts:
            raise ValueError(f"request id {rid!r} was already used")
        self.check_admission(request.owner)
        flight = Flight(pending_terminals=set(self.config.terminals), owner=request.owner)
        request = self.conversations.begin(request)
        self._flights[rid] = flight
        metrics.PIPELINE_REQUESTS_ACTIVE.set(len(self._flights))
        try:
            self._submit(flight, StagePayload(rid, request.inputs, request.params))
            while True:
                try:
                    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
                    # that lands as the item arrives, and a cancelled consumer must stop.
                    async with asyncio.timeout(self.config.stream_idle_timeout_s):
                        item = await flight.chunks.get()
                except TimeoutError:
                    idle = self.config.stream_idle_timeout_s
                    log.warning("request %s: no output for %g s: aborting it everywhere", rid, idle)
                    raise PipelineError("pipeline", f"no output for {idle:g} s (a stage stalled); "
                                        "the request was aborted") from None
                if item is None:
                    return
                if isinstance(item, PipelineError):
                    raise item
                yield item
        finally:
            # The inner finally: a second cancellation while the abort is awaited must not leak
            # the flight (it would count against max_in_flight forever).
            try:
                if not flight.finished:
                    await asyncio.shield(self.abort(rid))
            finally:
                self._end(rid)

    def _submit(self, flight: Flight, payload: StagePayload) -> None:
        """Send the request to the entry stage. One that cannot be queued (a full /dev/shm, the
        stage at its high-water mark) is held by no stage: its response fails, and the stream's
        end frees its slot, with no abort to wait for."""
        try:
            self._endpoint.send(self.config.entry, Submit(payload, COORDINATOR))
        except SendError as err:
            rid = payload.request_id
            log.error("request %s: not sent to stage %s: %s", rid, self.config.entry, err)
            flight.fail(PipelineError("pipeline", f"could not send the request: {err}"))
            self.conversations.end(rid, "failed", None)

    async def abort(self, request_id: str, keep_answer_tokens: int | None = None) -> None:
        """Broadcast an abort for ``request_id`` and wait until every stage acknowledged it.

        Idempotent: concurrent calls share one broadcast, a later call after the acks returns at once.
        For a request of a conversation (``params["conversation_id"]``), the state kept for the
        conversation goes back to before the request, or with ``keep_answer_tokens`` keeps the
        request's turn with its answer cut to that many tokens (barge-in: the ``answer_tokens`` of
        the last audio chunk the user heard). A cut also applies when the request already ended
        (its audio may still be playing then); a plain abort of an ended request changes nothing
        (``withdraw`` takes its turn out).
        """
        flight = self._flights.get(request_id)
        if flight is not None and not flight.finished:
            flight.finished = True
            flight.outcome = "aborted"
            flight.keep_answer_tokens = keep_answer_tokens
            flight.chunks.put_nowait(None)
        elif keep_answer_tokens is not None and not self._closed:
            # Completed already (its audio may still be playing): cut the turn it left kept.
            await self.conversations.cut_ended(request_id, keep_answer_tokens)
        pending = self._aborts.get(request_id)
        if pending is None:
            if (request_id in self._ended and flight is None) or self._closed:
                return
            pending = self._broadcast_abort(request_id)
        acknowledged = await self._await_abort(request_id, pending)
        if flight is not None:
            # The client may never finish iterating the aborted stream: the turn ends here. A cut
            # keeps the turn only where it had begun (every keeping stage says its state ends with
            # it); an abort some stage did not acknowledge leaves its state unknown, so the
            # conversation's kept state is dropped, as after a failure.
            kept = all(made_by == request_id for made_by in pending.kept_by.values())
            outcome = flight.outcome if acknowledged else "failed"
            self.conversations.end(request_id, outcome, flight.keep_answer_tokens, kept)

    async def withdraw(self, request_id: str) -> None:
        """Abort ``request_id`` as if never asked (a speculative answer the user talked over), acked
        as ``abort``: also where it ended, its turn leaves its conversation's kept state (undone
        where it is the last turn and nothing runs, else that state is dropped: a full prefill)."""
        flight = self._flights.get(request_id)
        if flight is None or (flight.finished and flight.outcome == "done"):
            if (pending := self._aborts.get(request_id)) is not None:
                await self._await_abort(request_id, pending)
            if not self._closed:
                await self.conversations.withdraw(request_id)
        await self.abort(request_id)

    async def close_conversation(self, conversation_id: str) -> None:
        """The session is gone: abort its request in flight and free every state kept for it."""
        await self.conversations.close(conversation_id)

    async def _cut(self, request_id: str, conversation: tuple[str, int | None]) -> bool:
        """Cut (or undo) the state a request left kept; False when some stage did not acknowledge."""
        if request_id in self._aborts:
            return True  # being aborted already: that abort's end settles the book
        return await self._await_abort(request_id, self._broadcast_abort(request_id, conversation))

    async def _await_abort(self, request_id: str, pending: PendingAbort) -> bool:
        """Wait for every stage's ack (or the abort timeout); True when every live stage acked."""
        try:
            await asyncio.wait_for(pending.done.wait(), self.config.abort_timeout_s)
        except TimeoutError:
            log.error(
                "request %s: abort not acknowledged by %s after %.1fs",
                request_id, sorted(pending.pending), self.config.abort_timeout_s,
            )
        finally:
            if self._aborts.get(request_id) is pending:
                del self._aborts[request_id]
                self._ended.add(request_id)
        return not pending.pending

    def _broadcast_abort(
        self, request_id: str, conversation: tuple[str, int | None] | None = None
    ) -> PendingAbort:
        """Send the abort to every live stage now; ``abort`` waits for the acks and cleans up.

        A stage the abort could not be sent to stays pending (it may hold the request): the
        abort then ends by its timeout."""
        if conversation is None:
            flight = self._flights.get(request_id)
            conversation = self.conversations.abort_target(
                request_id, flight.keep_answer_tokens if flight is not None else None
            )
        message = Abort(request_id) if conversation is None else Abort(request_id, *conversation)
        pending = PendingAbort(set(self._stages) - self._dead_stages(), time.perf_counter(), message)
        self._aborts[request_id] = pending
        for stage in pending.pending:
            self._send(stage, message)
        if not pending.pending:
            pending.done.set()
        return pending

    async def stage_stats(self, timeout: float = 5.0) -> dict[str, StageStats]:
        """A fresh StageStats from every live stage (asked now, answered after pending commands)."""
        # A stage the question cannot be sent to (not reading) is left out rather than waited for.
        asked, silent = await self._questions.ask(set(self._stages) - self._dead_stages(), timeout)
        if silent:
            raise TimeoutError(f"no stats from {sorted(silent)} within {timeout:g} s")
        return {s: self._questions.latest[s] for s in asked}

    @property
    def requests_in_flight(self) -> int:
        return len(self._flights)

    def check_admission(self, owner: str | None) -> None:
        """Raise PipelineOverloaded when a request of ``owner`` would be refused now: a caller
        that must decode a request's inputs first asks before doing that work."""
        admission.check(self.config, (f.owner for f in self._flights.values()), owner)

    # --- control plane --------------------------------------------------------------------

    def _end(self, rid: str) -> None:
        self._flights.pop(rid, None)
        self._ended.add(rid)
        metrics.PIPELINE_REQUESTS_ACTIVE.set(len(self._flights))

    def _dead_stages(self) -> set[str]:
        return set(self._crashed)

    async def _receive(self) -> None:
        while True:
            try:
                message = await self._endpoint.recv()
            except Exception as err:  # noqa: BLE001 - ReaderDied or any fault: never deaf for good
                self._on_reader_died(err)
                # A new reader starts at the next recv; one that dies again at once must not spin.
                await asyncio.sleep(self.config.restart_delay_s)
                self._in_background(self._hear_again())
                continue
            try:
                self._dispatch(message)
            except Exception:  # noqa: BLE001 - one bad message must not stop the coordinator
                log.exception("coordinator: failed to handle %s", type(message).__name__)

    def _dispatch(self, message: ControlMessage) -> None:
        match message:
            case StreamChunk(payload=payload, source=source):
                self._deliver(OutputChunk(payload.request_id, source, payload.data, final=False))
            case StreamDone(payload=payload, source=source):
                self._on_terminal_done(payload, source)
            case Failed(request_id=rid, source=source, error=error):
                self._on_failed(rid, source, error)
            case AbortAck(request_id=rid, source=source, kept_by=kept_by):
                pending = self._aborts.get(rid)
                if pending is not None and self.conversations.keeps(source):
                    pending.kept_by[source] = kept_by
                self._on_ack(rid, source)
            case StageStats():
                self._questions.on_stats(message)
            case Ready(source=source, keeps_conversations=keeps, caches_conversations=caches):
                self._ready_stages.add(source)
                self.conversations.on_ready(source, keeps, caches)
                if source in self._crashed:
                    self._on_recovered(source)
                if self._ready_stages >= set(self._stages):
                    self._all_ready.set()
            case StageCrashed(source=source, error=error):
                self.on_stage_crashed(source, error)
            case _:
                log.error("coordinator: unexpected message %s", type(message).__name__)

    def _deliver(self, chunk: OutputChunk) -> None:
        flight = self._flights.get(chunk.request_id)
        if flight is not None and not flight.finished:
            flight.chunks.put_nowait(chunk)

    def _on_terminal_done(self, payload: StagePayload, source: str) -> None:
        flight = self._flights.get(payload.request_id)
        if flight is None or flight.finished:
            return
        flight.chunks.put_nowait(OutputChunk(payload.request_id, source, payload.data, final=True))
        flight.pending_terminals.discard(source)
        if not flight.pending_terminals:
            flight.finished = True
            flight.outcome = "done"
            flight.chunks.put_nowait(None)
            self.conversations.end(payload.request_id, "done", None)

    def _on_ack(self, rid: str, source: str) -> None:
        pending = self._aborts.get(rid)
        if pending is None:
            return
        pending.pending.discard(source)
        if not pending.pending and not pending.done.is_set():
            metrics.PIPELINE_ABORT_CLEAR_SECONDS.observe(time.perf_counter() - pending.started)
            pending.done.set()
