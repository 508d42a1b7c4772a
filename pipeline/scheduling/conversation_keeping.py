"""The coordinator's side of kept conversation state: which stages keep it, the book, the budget.

Owned by the coordinator and run on its event loop. It turns the session's requests into requests
that continue kept state (``ConversationBook.begin``; first ``prepare`` lets the conversation's
request in flight end, and undoes an open turn the request abandons), learns how each ended, cuts
and drops kept state (and undoes the turn of an ended request withdrawn: ``withdraw``) in the
stages that keep conversations (those whose Ready said so), and after each turn
checks every keeping stage's bytes (a fresh StageStats) against its ``Budget``, evicting idle
conversations least recently used first. Nothing here holds per-request state beyond the book's
entry of a request in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.proto import DropConversation, OmniRequest, StageStats
from pipeline.scheduling.conversation_book import SESSION_PARAM, Budget, ConversationBook

log = logging.getLogger(__name__)

Cut = Callable[[str, tuple[str, int | None]], Awaitable[bool]]
"""Broadcast an Abort of (request, (conversation, answer tokens to keep)) and wait for the acks;
False when some stage did not acknowledge it in time (its state is then unknown)."""


class ConversationKeeping:
    def __init__(
        self,
        config: PipelineConfig,
        send: Callable[[str, Any], None],
        cut: Cut,
        abort: Callable[[str, int | None], Awaitable[None]],
        stage_stats: Callable[[], Awaitable[dict[str, StageStats]]],
        aborting: Callable[[str], bool],
    ) -> None:
        self.book = ConversationBook()
        self._budgets = {s.name: Budget.from_options(s.options) for s in config.stages}
        self._keepers: set[str] = set()
        self._caches: set[str] = set()  # stages that cache per-conversation work (dropped with it)
        self._send = send
        self._cut = cut
        self._abort = abort
        self._stage_stats = stage_stats
        self._aborting = aborting
        self._budget_task: asyncio.Task[None] | None = None
        self._budget_again = False
        self._wait_s = config.stream_idle_timeout_s
        self._ended: dict[str, asyncio.Event] = {}  # requests in flight that another one awaits

    # --- requests -------------------------------------------------------------------------

    async def prepare(self, request: OmniRequest) -> None:
        """Before ``begin``: wait for the conversation's request in flight where it is about to
        end (a piece of the user's turn prefilled while they spoke, or a request whose abort is
        being acknowledged: short, and what this request continues), then undo the open turn this
        request abandons. Another request in flight, or one that outlasts the stream timeout, is
        not waited for: this request then keeps nothing (``begin`` of a busy conversation)."""
        cid = request.params.get(SESSION_PARAM)
        if not self._keepers or cid is None:
            return
        try:
            async with asyncio.timeout(self._wait_s):
                while (busy := self.book.busy_request(str(cid))) is not None:
                    if not (self.book.partial(str(cid)) or self._aborting(busy)):
                        return
                    await self._ended.setdefault(busy, asyncio.Event()).wait()
        except TimeoutError:
            log.warning("conversation %s: request %s still runs; request %s keeps nothing",
                        cid, self.book.busy_request(str(cid)), request.request_id)
            return
        undo = self.book.open_to_undo(request)
        if undo is not None:
            log.info("conversation %s: the open turn of %s is abandoned; undone", cid, undo)
            if await self._cut(undo, (str(cid), None)):
                self.book.undo_open(str(cid))
            else:
                self._forget(str(cid))

    def begin(self, request: OmniRequest) -> OmniRequest:
        """The request to submit (see ConversationBook.begin); unchanged when no stage keeps any."""
        if not self._keepers or request.params.get(SESSION_PARAM) is None:
            return request
        return self.book.begin(request)

    def abort_target(self, request_id: str, keep: int | None) -> tuple[str, int | None] | None:
        """What an Abort of a request in flight says about its conversation, or None."""
        cid = self.book.conversation_of(request_id)
        return None if cid is None else (cid, keep)

    def end(self, request_id: str, outcome: str, keep: int | None, turn_kept: bool = True) -> None:
        """A request ended (done, failed, or aborted once every stage acknowledged): a
        conversation's turn updates the book, and the budget is checked."""
        ended = self._ended.pop(request_id, None)
        if ended is not None:
            ended.set()
        cid = self.book.conversation_of(request_id)
        if cid is None:
            return
        if self.book.end(request_id, outcome, keep, turn_kept):
            self._drop(cid, None)
        self._check_budget()

    # --- client API (through the coordinator) ---------------------------------------------

    async def cut_ended(self, request_id: str, keep_answer_tokens: int) -> None:
        """A barge-in on a request that already ended: cut it if it made a kept state."""
        for cid in self.book.conversations_made_by(request_id):
            if not await self._cut(request_id, (cid, keep_answer_tokens)):
                self._forget(cid)

    async def withdraw(self, request_id: str) -> None:
        """An ended request is withdrawn (``Coordinator.withdraw``): where its turn is the last of
        an idle conversation, the stages undo it (an Abort that keeps no answer, acknowledged as
        every abort; meanwhile the conversation's next request waits in ``prepare``); where later
        turns were built on it, the conversation's kept state is dropped (a full prefill next)."""
        cid, undo = self.book.withdraw(request_id)
        if cid is None:
            return
        acknowledged = False
        try:
            if undo:
                log.info("conversation %s: the turn of %s is withdrawn; undone", cid, request_id)
                acknowledged = await self._cut(request_id, (cid, None))
        finally:
            self.book.withdrawn(request_id)
            ended = self._ended.pop(request_id, None)
            if ended is not None:
                ended.set()
            if not acknowledged:
                log.info("conversation %s: %s is withdrawn; its kept state is dropped", cid, request_id)
                self._forget(cid)

    async def close(self, cid: str) -> None:
        """The session closed: abort its request in flight, then free everything kept for it."""
        busy = self.book.busy_request(cid)
        if busy is not None:
            await self._abort(busy, None)
        self._forget(cid)

    def stop(self) -> None:
        """The coordinator closes: no budget check may outlive it."""
        if self._budget_task is not None:
            self._budget_task.cancel()

    # --- stages ---------------------------------------------------------------------------

    def keeps(self, stage: str) -> bool:
        return stage in self._keepers

    def keeps_any(self) -> bool:
        """Whether some ready stage keeps conversations (not only caches them)."""
        return bool(self._keepers)

    def on_ready(self, stage: str, keeps: bool, caches: bool) -> None:
        for stages, has in ((self._keepers, keeps), (self._caches, caches)):
            if has:
                stages.add(stage)
            else:
                stages.discard(stage)

    def on_crash(self, stage: str) -> None:
        if stage in self._keepers:
            self.book.clear()

    async def enforce_budget(self) -> None:
        """Evict what every keeping stage holds beyond its budget, on a fresh report of its bytes."""
        if not self._keepers:
            return
        stats = await self._stage_stats()
        for stage in sorted(self._keepers & set(stats)):
            for cid, rid in self.book.evictions(stats[stage].conversations, self._budgets[stage]):
                log.info("conversation %s: kept state evicted (stage %s over budget)", cid, stage)
                self._drop(cid, rid)

    def _forget(self, cid: str) -> None:
        """Nobody vouches for what the stages keep for ``cid`` (a cut some stage did not
        acknowledge, or the session closed): free it everywhere; its next request starts afresh."""
        self.book.close(cid)
        self._drop(cid, None)

    def _drop(self, cid: str, rid: str | None) -> None:
        for stage in self._keepers:
            self._send(stage, DropConversation(cid, rid))
        for stage in self._caches - self._keepers:
            self._send(stage, DropConversation(cid, None))  # a cache holds no request's state

    def _check_budget(self) -> None:
        """Run ``enforce_budget`` after a turn: one run at a time, again if a turn ended meanwhile."""
        if self._budget_task is not None and not self._budget_task.done():
            self._budget_again = True
            return
        self._budget_task = asyncio.get_running_loop().create_task(self._budget_loop())

    async def _budget_loop(self) -> None:
        while True:
            self._budget_again = False
            try:
                await self.enforce_budget()
            except Exception:  # noqa: BLE001 - a missed check is retried after the next turn
                log.exception("conversation budget check failed")
            if not self._budget_again:
                return
