"""The worker thread of a stage: the only thread that touches the stage's scheduler.

It applies, in order, the commands the stage's event loop queues (add, feed, close a stream, a
stats question), and steps the scheduler while it has work; compute never runs on the event loop.
Aborts ride an urgent lane: they are applied before any command queued ahead of them, checked
between every two commands and before each step, so an abort does not wait behind the data a
saturated stage has queued (the abort-to-clear budget is 20 ms). Each command's outcome goes back
to the loop through the callbacks given (``call_soon_threadsafe``).

Owned state, for the thread's life: the command queues, and ``_ended``: requests the scheduler
finished, failed or aborted, whose commands still queued are skipped so that they cannot recreate
state that nothing would release (an abort may overtake commands queued for its request).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.proto import RecentIds
from pipeline.scheduling.base import (
    ConversationScheduler,
    RequestFailure,
    Scheduler,
    StepResult,
    describe_error,
)

log = logging.getLogger(__name__)

ENDED_MEMORY = 65536
"""How many ended request ids the worker remembers, to skip their queued commands."""

Counts = tuple[int, int, dict[str, int]]
"""What the worker reports after a command or step: live requests, queue depth, kept sizes."""

OnResults = Callable[[list[StepResult], Counts, float | None, int | None], None]
"""(results, counts, step seconds or None, stats token or None), called on the loop."""
OnAbortDone = Callable[[str, Counts, str | None], None]
"""(request id, counts, kept_by), called on the loop once the scheduler let go of the request."""
OnDied = Callable[[str], None]
"""(error), called on the loop when the worker stopped for good."""


@dataclass
class _Command:
    request_id: str | None
    run: Callable[[], None]


_WAKE = _Command(None, lambda: None)
"""Put on the ordinary lane after an urgent command: it wakes a worker waiting for commands."""


class StageWorker:
    def __init__(
        self,
        name: str,
        scheduler: Scheduler,
        keeper: ConversationScheduler | None,
        loop: asyncio.AbstractEventLoop,
        callbacks: tuple[OnResults, OnAbortDone, OnDied],
    ) -> None:
        self.name = name
        self._scheduler = scheduler
        self._keeper = keeper
        self._loop = loop
        self._on_results, self._on_abort_done, self._on_died = callbacks
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._urgent: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._ended = RecentIds(ENDED_MEMORY)
        self._cpu_seen = 0.0  # the thread's CPU seconds at the last ``progressed`` (loop's)
        self._thread = threading.Thread(target=self._work, name=f"stage-{name}", daemon=True)

    # --- called on the event loop ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        """Stop after the commands queued so far (the step in progress ends first)."""
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)

    def queue(self, rid: str | None, run: Callable[[], None]) -> None:
        """Run ``run`` in the worker; for a request (``rid``), skipped once it ended there."""
        self._commands.put(_Command(rid, run))

    def abort(self, rid: str, conversation: tuple[str, int | None] | None = None) -> None:
        """Release ``rid`` (ahead of queued commands); ``on_abort_done`` follows."""
        self._urgent.put(_Command(None, lambda: self._abort(rid, conversation)))
        self._commands.put(_WAKE)

    def drop_conversation(self, cid: str, rid: str | None) -> None:
        self.queue(None, lambda: self._drop_conversation(cid, rid))

    def ask_counts(self, token: int) -> None:
        """Counts after every command queued so far, reported with ``token``."""
        self.queue(None, lambda: self._post(self._on_results, [], self._counts(), None, token))

    def depth(self) -> int:
        """Commands waiting (both lanes)."""
        return self._commands.qsize() + self._urgent.qsize()

    def progressed(self) -> bool:
        """Whether the worker thread used CPU time since the previous call: a step that computes
        (on the CPU, or waiting on a GPU, which torch does by spinning) does, a worker blocked for
        good (a deadlock, a wait that never returns) does not. False where the thread's CPU clock
        cannot be read (not Linux): the worker then answers for itself between two steps."""
        ident = self._thread.ident
        if ident is None or not self._thread.is_alive():  # a finished thread's id names no clock
            return False
        try:
            used = time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (AttributeError, OSError):
            return False
        ran, self._cpu_seen = used > self._cpu_seen, used
        return ran

    # --- worker thread --------------------------------------------------------------------

    def _post(self, callback: Callable[..., None], *args: object) -> None:
        self._loop.call_soon_threadsafe(callback, *args)

    def _counts(self) -> Counts:
        return (
            self._scheduler.live_requests(),
            self._scheduler.queue_depth(),
            self._keeper.conversation_sizes() if self._keeper is not None else {},
        )

    def _abort(self, rid: str, conversation: tuple[str, int | None] | None) -> None:
        kept_by = None
        self._ended.add(rid)  # it may overtake commands queued for the request before it
        try:
            if conversation is None or self._keeper is None:
                self._scheduler.abort(rid)
            else:
                kept_by = self._keeper.abort_conversation(rid, *conversation)
        finally:
            # Schedulers drop a request's entry before releasing it, so even a release that raised
            # left nothing to serve: acknowledge either way, or the abort would wait for nothing.
            self._post(self._on_abort_done, rid, self._counts(), kept_by)

    def _drop_conversation(self, cid: str, rid: str | None) -> None:
        if self._keeper is not None:
            self._keeper.drop_conversation(cid, rid)
        self._post(self._on_results, [], self._counts(), None, None)

    def _work(self) -> None:
        try:
            self._serve_commands()
        except Exception as err:  # noqa: BLE001 - a scheduler bug: reported, not a silent hang
            log.exception("stage %s: worker failed", self.name)
            self._post(self._on_died, describe_error(err))

    def _run_urgent(self) -> None:
        """Apply the aborts waiting in the urgent lane, ahead of every other queued command."""
        while not self._urgent.empty():  # checked before every command: no exception to raise
            command = self._urgent.get_nowait()  # this thread is the only consumer
            try:
                command.run()
            except Exception:  # noqa: BLE001 - acknowledged anyway (see _abort)
                log.exception("stage %s: abort failed", self.name)

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
                self._run_urgent()
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
            self._run_urgent()
            if failures:
                self._post(self._on_results, failures, self._counts(), None, None)
            if self._scheduler.has_work():
                started = time.perf_counter()
                results = self._scheduler.step()
                elapsed = time.perf_counter() - started
                for result in results:
                    if isinstance(result, RequestFailure) or result.final:
                        self._ended.add(result.request_id)
                self._post(self._on_results, results, self._counts(), elapsed, None)
