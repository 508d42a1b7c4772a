"""The ``ar`` scheduler: continuous batching of autoregressive requests with output caps.

Every step runs all runnable requests together (up to ``max_batch``, oldest first): new ones
prefill, the others decode one step; a request joins the batch on the step after it arrives and
leaves it the step it finishes. Per-request state is one ARSlot (the runner's KV cache and counters
inside), created by the request's first input and released through ``ARRunner.release`` when the
request finishes, fails or is aborted. The cap counts steps: no request can decode forever, whatever
the runner does.

With a ``ConversationRunner`` the scheduler also keeps per-conversation state between requests
(``KeptConversations``): a request of a conversation starts from its kept state, and its end puts
state back (the whole turn when it finished, what came before it when it failed or was aborted,
the turn cut to what was heard when an abort says so). Kept state is not counted as live requests.
With a ``ConversationCache`` runner, the scheduler only frees the runner's cache of a conversation
with it and counts it with kept state.
"""

from __future__ import annotations

import logging

from pipeline.proto import StagePayload
from pipeline.scheduling.base import (
    ARRunner,
    ARSlot,
    ConversationCache,
    ConversationRunner,
    RequestError,
    RequestFailure,
    StageOutput,
    StepResult,
    describe_error,
)
from pipeline.scheduling.conversations import (
    PREVIOUS_KEY,
    SLOT_KEY,
    KeptConversations,
    conversation_of,
)

log = logging.getLogger(__name__)


class ARScheduler:
    def __init__(
        self, runner: ARRunner, max_batch: int, max_new_tokens: int, cap_param: str | None
    ) -> None:
        self._runner = runner
        self._max_batch = max_batch
        self._max_new_tokens = max_new_tokens
        self._cap_param = cap_param
        self._slots: dict[str, ARSlot] = {}
        self._kept = KeptConversations(runner) if isinstance(runner, ConversationRunner) else None
        self.keeps_conversations = self._kept is not None
        self._cache = runner if isinstance(runner, ConversationCache) else None
        self.caches_conversations = self._cache is not None

    def _slot(self, payload: StagePayload) -> ARSlot:
        slot = self._slots.get(payload.request_id)
        if slot is None:
            cap = self._max_new_tokens
            if self._cap_param is not None and payload.params.get(self._cap_param) is not None:
                cap = max(1, min(cap, int(payload.params[self._cap_param])))
            ref = conversation_of(payload.params) if self._kept is not None else None
            made_by = None
            if ref is None:
                state = self._runner.new_state(payload)
            else:
                state, made_by = self._kept.start(ref, payload)
            slot = ARSlot(payload.request_id, payload.params, state, cap)
            if ref is not None:
                slot.extra[SLOT_KEY], slot.extra[PREVIOUS_KEY] = ref.id, made_by
            self._slots[payload.request_id] = slot
        return slot

    def add(self, payload: StagePayload) -> None:
        self._slot(payload).input_closed = True

    def feed(self, payload: StagePayload) -> None:
        self._runner.feed(self._slot(payload), payload)

    def close_stream(self, payload: StagePayload) -> None:
        slot = self._slot(payload)
        slot.input_closed = True
        self._runner.close_input(slot, payload)

    def abort(self, request_id: str) -> None:
        self._release(request_id)

    def abort_conversation(
        self, request_id: str, conversation_id: str, keep_answer_tokens: int | None
    ) -> str | None:
        if request_id in self._slots:
            self._release(request_id, keep_answer_tokens)
        elif self._kept is not None:
            self._kept.abort_finished(request_id, conversation_id, keep_answer_tokens)
        return None if self._kept is None else self._kept.made_by(conversation_id)

    def drop_conversation(self, conversation_id: str, request_id: str | None) -> None:
        if self._kept is not None:
            self._kept.drop(conversation_id, request_id)
        if self._cache is not None:
            self._cache.drop_cached(conversation_id)

    def conversation_sizes(self) -> dict[str, int]:
        sizes = {} if self._kept is None else self._kept.sizes()
        for cid, nbytes in ({} if self._cache is None else self._cache.cached_conversations()).items():
            sizes[cid] = sizes.get(cid, 0) + nbytes
        return sizes

    def _release(
        self, request_id: str, keep_answer_tokens: int | None = None, finished: bool = False
    ) -> None:
        """Free a request's slot: it finished, failed or was aborted. A conversation's slot first
        gives back its kept state (see ``KeptConversations.end``)."""
        slot = self._slots.pop(request_id, None)
        if slot is None:
            return
        try:
            if self._kept is not None:
                self._kept.end(slot, keep_answer_tokens, whole=finished)
        finally:
            self._runner.release(slot)

    def has_work(self) -> bool:
        return any(self._runner.runnable(s) for s in self._slots.values())

    def step(self) -> list[StepResult]:
        batch = [s for s in self._slots.values() if self._runner.runnable(s)][: self._max_batch]
        try:
            step_results = self._runner.step(batch)
        except RequestError as err:
            return [self._fail(self._slots[err.request_id], err)]
        except Exception as err:  # noqa: BLE001 - a batched forward cannot tell whose fault it was
            return [self._fail(slot, err) for slot in batch]
        outputs: list[StepResult] = []
        for slot, result in zip(batch, step_results, strict=True):
            slot.steps += 1
            if result.data is not None:
                outputs.append(StageOutput(slot.request_id, result.data))
            runner_cap = self._runner.output_cap(slot)
            cap = slot.cap if runner_cap is None else min(slot.cap, runner_cap)
            if result.finished or slot.steps >= cap:
                capped = not result.finished
                if capped:
                    log.info("request %s: output cap %d reached", slot.request_id, cap)
                final = self._runner.finish(slot, capped=capped)
                outputs.append(StageOutput(slot.request_id, final or {}, final=True))
                self._release(slot.request_id, finished=True)
        return outputs

    def _fail(self, slot: ARSlot, err: BaseException) -> RequestFailure:
        log.warning("request %s failed: %s", slot.request_id, describe_error(err))
        self._release(slot.request_id)
        return RequestFailure(slot.request_id, describe_error(err))

    def live_requests(self) -> int:
        return len(self._slots)

    def queue_depth(self) -> int:
        return sum(1 for s in self._slots.values() if s.steps == 0)
