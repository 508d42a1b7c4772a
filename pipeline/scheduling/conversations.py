"""Per-conversation state that an ``ar`` scheduler keeps between requests (see base.py).

A request names its conversation in ``params["conversation"]`` = ``{"id": str, "resume": bool,
"covered_s": int}``, which the coordinator sets (``conversation_book.py``): ``resume`` means the
request's inputs hold only what is new since the conversation's kept state, and the runner
continues that state; without it the request starts the conversation's state afresh (any older
state is dropped first). ``covered_s`` (optional): the kept state ends inside the first message
given (an open turn, prefilled while the user spoke), after that many seconds of its audio.

Who owns what: a ``KeptConversations`` belongs to one scheduler and is driven from its worker
thread only. It owns every kept object (the runner's: e.g. the thinker's KV cache and token ids)
from the end of the request that made it until one of:
- the conversation's next request takes it over (``start`` with resume) — while that request runs
  the state is per-request state in its slot again, and its end (finish, abort, failure) puts a
  kept object back: the whole turn, the turn cut to what the user heard, or the state from before;
- ``drop`` (the session closed, or the coordinator evicted it to stay within its budget);
- ``truncate`` of its last request to nothing (an abort of the request that started it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pipeline.proto import StagePayload
from pipeline.scheduling.base import ARSlot, ConversationRunner, RequestError

log = logging.getLogger(__name__)

CONVERSATION_PARAM = "conversation"
"""Request param the coordinator sets on a request of a conversation that a stage keeps."""

SLOT_KEY = "conversation"
"""Key in ``ARSlot.extra``: the conversation id of a slot whose state will be kept."""

PREVIOUS_KEY = "conversation_made_by"
"""Key in ``ARSlot.extra``: the request that made the kept state this slot continues."""


@dataclass(frozen=True)
class ConversationRef:
    id: str
    resume: bool
    covered_s: int = 0


def conversation_of(params: dict[str, Any]) -> ConversationRef | None:
    """The conversation a request belongs to, from its params, or None."""
    value = params.get(CONVERSATION_PARAM)
    if not isinstance(value, dict) or not value.get("id"):
        return None
    return ConversationRef(str(value["id"]), bool(value.get("resume")), int(value.get("covered_s") or 0))


@dataclass
class _Kept:
    state: Any
    request_id: str
    """The request that made this state (its last turn); aborts of that request still reach it."""
    nbytes: int


class KeptConversations:
    """The kept state of every conversation of one scheduler, keyed by conversation id."""

    def __init__(self, runner: ConversationRunner) -> None:
        self._runner = runner
        self._kept: dict[str, _Kept] = {}

    def start(self, ref: ConversationRef, payload: StagePayload) -> tuple[Any, str | None]:
        """Per-request state for a new request of conversation ``ref``, and the request that made
        the kept state it continues (None: it starts afresh)."""
        if not ref.resume:
            self.drop(ref.id, None)
            return self._runner.new_state(payload), None
        kept = self._kept.get(ref.id)
        if kept is None:
            raise RequestError(payload.request_id, f"conversation {ref.id!r} holds no state here")
        state = self._runner.resume(kept.state, payload)
        del self._kept[ref.id]  # taken over only once resume accepted the payload
        return state, kept.request_id

    def end(self, slot: ARSlot, answer_tokens: int | None, whole: bool) -> None:
        """A conversation slot ends: keep its whole turn (``whole``, it finished), or the turn cut to
        ``answer_tokens`` answer tokens, or (None) the state from before the request."""
        cid = slot.extra.get(SLOT_KEY)
        if cid is None or slot.state is None:
            return
        maker = slot.request_id
        try:
            if not whole and not self._runner.started(slot):
                # Nothing of this request is in the state: it stays the previous request's turn.
                kept, maker = self._runner.keep(slot), slot.extra.get(PREVIOUS_KEY)
            else:
                kept = self._runner.keep(slot)
                if not whole:
                    kept = self._runner.truncate(kept, answer_tokens)
        except Exception:  # noqa: BLE001 - a state we cannot vouch for is dropped, not kept
            log.exception("conversation %s: could not keep its state; dropped", cid)
            return
        if kept is not None and maker is not None:
            self._put(cid, kept, maker)

    def abort_finished(self, request_id: str, cid: str, answer_tokens: int | None) -> None:
        """An abort of the request that made ``cid``'s kept state, after it finished here."""
        kept = self._kept.get(cid)
        if kept is None or kept.request_id != request_id:
            return
        del self._kept[cid]
        try:
            state = self._runner.truncate(kept.state, answer_tokens)
        except Exception:  # noqa: BLE001
            log.exception("conversation %s: could not cut its state; dropped", cid)
            return
        if state is not None:
            self._put(cid, state, request_id)

    def drop(self, cid: str, request_id: str | None) -> None:
        kept = self._kept.get(cid)
        if kept is None or (request_id is not None and kept.request_id != request_id):
            return
        del self._kept[cid]
        self._runner.drop(kept.state)

    def made_by(self, cid: str) -> str | None:
        """The request whose turn ``cid``'s kept state ends with (None: nothing kept)."""
        kept = self._kept.get(cid)
        return None if kept is None else kept.request_id

    def sizes(self) -> dict[str, int]:
        return {cid: kept.nbytes for cid, kept in self._kept.items()}

    def _put(self, cid: str, state: Any, request_id: str) -> None:
        self.drop(cid, None)  # a request that started afresh may meet an older state: replace it
        self._kept[cid] = _Kept(state, request_id, self._runner.kept_bytes(state))
