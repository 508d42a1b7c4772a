"""The coordinator's book of conversations whose state stages keep, and its memory policy.

The session's side of the contract (model-agnostic; ``OmniRequest.inputs["messages"]`` is the
pipeline's one input shape):
- every request of a conversation carries ``params["conversation_id"]`` and, as before, the whole
  history in ``inputs["messages"]``, oldest first;
- the history the kept state covers is the previous request's messages plus its answer, so the
  next request continues it when its messages extend that (its message at that index is the
  assistant's answer, cut to what was heard after a barge-in, and new messages follow). Optionally
  ``params["conversation_kept_messages"]`` states the session's own count of those messages; a
  request that does not continue the kept state (another count, an edited history, no kept state:
  the first turn, after an eviction, a failure or a restart) is a full prefill that starts the
  conversation's state afresh: the answer is the same, only slower (exactly the same when the
  history's assistant text tokenizes back to the tokens the model produced);
- a session that edits what came before (new instructions, a deleted or inserted item) calls
  ``Coordinator.close_conversation`` or takes a new conversation id: the book cannot see edits.

Prefill while the user speaks: a request with ``params["prefill_until_s"] = S`` (whole seconds)
is a partial turn: its last message is a user turn still being spoken, whose audio so far is
given; the stages prefill its first S seconds into the kept state and answer nothing. The state
then ends inside that message (an "open" turn). Every later request of the conversation says how
much of its last message's audio it believes the state holds (``params["conversation_open_s"]``,
absent: none): the same S continues the open turn (the next piece, or the answer: only the audio
after S is new), anything else abandons it (a turn the VAD dropped), and the open turn is undone
first (``open_to_undo``, then ``undo_open``), back to the state before that turn began.

A request withdrawn after it ended (a speculative answer the user talked over, all generated
before its abort: ``Coordinator.withdraw``) is undone where its turn is the last of an idle
conversation (``withdraw``, then ``withdrawn``: back to the state before it); where later turns
were built on it, the conversation's state is dropped; where its turn is no longer in the state
(the conversation started afresh since, or was closed), nothing is to be done.

Who owns what: the coordinator owns this book (its event loop only). A record lives from a
conversation's first request until ``close`` (the session closed) or a stage crash; the state it
describes lives in the stages that keep conversations (``conversations.py``) and is dropped when
the record says so: ``close``, a failed request, or an eviction. Evictions pick idle conversations
(no request in flight), least recently used first, until every keeping stage is within its
``Budget``; a conversation over the per-conversation budget is dropped once idle.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from pipeline.proto import OmniRequest
from pipeline.scheduling.conversations import CONVERSATION_PARAM

SESSION_PARAM = "conversation_id"
"""Request param naming the conversation a request continues (set by the session)."""

SESSION_KEPT_PARAM = "conversation_kept_messages"
"""Optional request param: how many leading messages the session believes the kept state covers."""

PARTIAL_PARAM = "prefill_until_s"
"""Request param of a partial turn: prefill the last message's first N seconds of audio, answer nothing."""

PARTIAL_MARGIN_MS = 50
"""Audio a partial turn carries past its N seconds (a model may read that far to compute them)."""

OPEN_PARAM = "conversation_open_s"
"""Request param: seconds of the last message's audio the session believes the kept state holds."""

TURNS_REMEMBERED = 4096
"""Ended requests whose turn went into a kept state that the book remembers (for ``withdraw``)."""

OPTIONS_KEY = "conversation_state"
"""Stage option with the budget of a stage that keeps conversations."""


@dataclass(frozen=True)
class Budget:
    """Bytes of kept conversation state one stage may hold (defaults fit a GPU next to a 30B MoE
    thinker: ~100 KiB of KV per token there, so a 512 MiB conversation is ~5k tokens)."""

    max_bytes: int = 4 << 30
    max_bytes_per_conversation: int = 512 << 20

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Budget:
        return cls(**options.get(OPTIONS_KEY, {}))


Before = tuple[bool, int, int, bool]
"""A record's (kept, covers, open_s, under_open): what undoing a request goes back to."""


@dataclass
class _Record:
    kept: bool = False
    """Whether the stages hold state for this conversation that the next request may continue."""
    covers: int = 0
    """Leading messages of the history that the kept state covers."""
    last_request: str | None = None
    """The request that made the kept state; drops and cuts name it, so they never hit newer state."""
    busy: str | None = None
    """The conversation's request in flight, if any."""
    resumed: bool = False
    """Whether ``busy`` continues kept state (else it started afresh)."""
    messages: int = 0
    """How many messages ``busy`` carried."""
    until: int = 0
    """``busy``'s ``prefill_until_s`` (0: it answers)."""
    open_s: int = 0
    """Seconds of audio of message ``covers`` (the open turn) the kept state holds (0: none)."""
    under_open: bool = False
    """Whether the stages keep a state from before the open turn (else undoing it leaves nothing)."""
    last_used: int = 0
    generation: int = 0
    """Which state this is: a request that starts the conversation's state afresh takes a new one."""
    start: Before = (False, 0, 0, False)
    """What the kept state was when ``busy`` began (what undoing it goes back to)."""
    before: Before | None = None
    """What undoing ``last_request`` goes back to (None: it cannot be undone)."""

    def restore(self, before: Before) -> None:
        self.kept, self.covers, self.open_s, self.under_open = before


class ConversationBook:
    """Which conversations the stages keep, what each covers, and which to evict."""

    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}
        self._by_request: dict[str, str] = {}
        self._turns: dict[str, tuple[str, int]] = {}  # ended request -> (conversation, generation)
        self._clock = itertools.count(1)
        self._generations = itertools.count(1)

    def begin(self, request: OmniRequest) -> OmniRequest:
        """The request to submit: tagged with its conversation, its inputs cut to what is new when
        it continues kept state. A second request while one is in flight keeps nothing."""
        cid = str(request.params[SESSION_PARAM])
        record = self._records.setdefault(cid, _Record())
        messages = request.inputs.get("messages")
        if record.busy is not None or not isinstance(messages, list):
            return request
        resume = record.kept and self._continues(record, messages, request.params)
        inputs = {**request.inputs, "messages": messages[record.covers:]} if resume else request.inputs
        ref: dict[str, Any] = {"id": cid, "resume": resume}
        if resume and record.open_s:
            ref["covered_s"] = record.open_s
        params = {**request.params, CONVERSATION_PARAM: ref}
        record.busy, record.resumed, record.messages = request.request_id, resume, len(messages)
        if resume:
            record.start = (True, record.covers, record.open_s, record.under_open)
        else:
            record.start, record.generation = (False, 0, 0, False), next(self._generations)
        record.until = partial_until(request.params)
        self._by_request[request.request_id] = cid
        return replace(request, inputs=inputs, params=params)

    @staticmethod
    def _continues(record: _Record, messages: list[Any], params: dict[str, Any]) -> bool:
        claimed = params.get(SESSION_KEPT_PARAM)
        if claimed is not None and claimed != record.covers:
            return False
        if params.get(OPEN_PARAM, 0) != record.open_s or len(messages) <= record.covers:
            return False
        if record.open_s:
            until = partial_until(params)
            turn = messages[record.covers]
            return (isinstance(turn, dict) and turn.get("role") == "user" and turn.get("audio") is not None
                    and (not until or until > record.open_s))
        answer = messages[record.covers - 1]
        return isinstance(answer, dict) and answer.get("role") == "assistant"

    def partial(self, cid: str) -> bool:
        """Whether the conversation's request in flight is a partial turn."""
        record = self._records.get(cid)
        return record is not None and record.busy is not None and bool(record.until)

    def open_to_undo(self, request: OmniRequest) -> str | None:
        """The request that made the open turn ``request`` abandons (it claims another share of
        it, or none): the stages must undo that turn (an Abort of it that keeps no answer) before
        ``request`` begins, and ``undo_open`` then says so here."""
        record = self._records.get(str(request.params.get(SESSION_PARAM)))
        if record is None or record.busy is not None or not record.kept or not record.open_s:
            return None
        return None if request.params.get(OPEN_PARAM, 0) == record.open_s else record.last_request

    def undo_open(self, cid: str) -> None:
        record = self._records[cid]
        record.kept, record.open_s, record.under_open = record.under_open, 0, False
        record.before = None

    def conversation_of(self, request_id: str) -> str | None:
        """The conversation of a request in flight that keeps state."""
        return self._by_request.get(request_id)

    def end(
        self, request_id: str, outcome: str, keep_answer_tokens: int | None, turn_kept: bool = True
    ) -> bool:
        """A request of a conversation ended: ``done``, ``aborted`` or ``failed``; ``turn_kept``:
        an abort that kept answer tokens found the request begun in every keeping stage (else its
        state is the one from before it). True when the stages must drop the conversation's state
        (after a failure nobody vouches for it)."""
        cid = self._by_request.pop(request_id, None)
        record = self._records.get(cid) if cid is not None else None
        if cid is None or record is None or record.busy != request_id:
            return False
        record.busy = None
        record.last_used = next(self._clock)
        cut = outcome == "aborted" and keep_answer_tokens is not None and turn_kept and not record.until
        if outcome == "done" and record.until:
            if not (record.resumed and record.open_s):  # this piece opened the turn
                record.under_open = record.resumed
            record.kept, record.covers, record.open_s = True, record.messages - 1, record.until
            # Undoing a piece undoes its whole open turn (as ``undo_open``).
            record.before = (record.under_open, record.covers, 0, False)
            self._remember(request_id, cid, record)
        elif outcome == "done" or cut:
            record.kept, record.covers, record.open_s = True, record.messages + 1, 0
            record.before = record.start
            self._remember(request_id, cid, record)
        elif outcome == "aborted" and not record.until:
            # Stages went back to the state before the request: nothing, if it started afresh.
            record.kept = record.kept and record.resumed
        else:  # failed, or a piece of an open turn aborted (what it leaves is not worth its book)
            record.kept = False
            return True
        return False

    def _remember(self, request_id: str, cid: str, record: _Record) -> None:
        record.last_request = request_id
        self._turns[request_id] = (cid, record.generation)
        if len(self._turns) > TURNS_REMEMBERED:
            del self._turns[next(iter(self._turns))]

    def withdraw(self, request_id: str) -> tuple[str | None, bool]:
        """An ended request is withdrawn: (its conversation, whether to undo its turn) where its
        turn is in the conversation's kept state (else (None, False): nothing to do). Undo: its
        turn is the idle conversation's last and can be undone; the conversation is then busy
        with the undo until ``withdrawn``. Else later turns were built on it (or one runs now)
        and the caller drops the conversation's state."""
        cid, generation = self._turns.pop(request_id, (None, 0))
        record = self._records.get(cid) if cid is not None else None
        if cid is None or record is None or record.generation != generation or not record.kept:
            return None, False
        if record.busy is None and record.last_request == request_id and record.before is not None:
            record.busy, record.until = request_id, 0
            self._by_request[request_id] = cid
            return cid, True
        return cid, False

    def withdrawn(self, request_id: str) -> None:
        """The stages undid ``request_id``'s turn (``withdraw``): the state is the one before it."""
        cid = self._by_request.pop(request_id, None)
        record = self._records.get(cid) if cid is not None else None
        if record is None or record.busy != request_id or record.before is None:
            return
        kept = record.kept  # False if a keeping stage restarted with nothing meanwhile
        record.busy, record.last_used = None, next(self._clock)
        record.restore(record.before)
        record.kept, record.before = kept and record.kept, None

    def busy_request(self, cid: str) -> str | None:
        record = self._records.get(cid)
        return None if record is None else record.busy

    def last_request(self, cid: str) -> str | None:
        """The request whose state the stages keep for ``cid`` (when idle and kept)."""
        record = self._records.get(cid)
        if record is None or not record.kept or record.busy is not None:
            return None
        return record.last_request

    def conversations_made_by(self, request_id: str) -> list[str]:
        """The conversation whose kept state ``request_id`` made, if it is idle (zero or one)."""
        return [cid for cid in self._records if self.last_request(cid) == request_id]

    def close(self, cid: str) -> None:
        self._records.pop(cid, None)
        self._by_request = {rid: c for rid, c in self._by_request.items() if c != cid}

    def clear(self) -> None:
        """A keeping stage restarted with nothing: every conversation starts afresh next time."""
        for record in self._records.values():
            record.kept = False

    def evictions(self, sizes: dict[str, int], budget: Budget) -> list[tuple[str, str | None]]:
        """(conversation, request that made its state) to drop so that one stage holding ``sizes``
        (bytes per conversation) keeps within ``budget``; the book forgets their state at once."""
        drops: list[tuple[str, str | None]] = []
        total = sum(sizes.values())
        idle: list[tuple[int, str]] = []
        for cid, size in sizes.items():
            record = self._records.get(cid)
            if record is not None and record.busy is not None:
                continue
            if record is None or not record.kept:  # left over (closed, failed): never continued
                drops.append((cid, None))
            elif size > budget.max_bytes_per_conversation:
                drops.append((cid, record.last_request))
            else:
                idle.append((record.last_used, cid))
                continue
            total -= size
        for _, cid in sorted(idle):
            if total <= budget.max_bytes:
                break
            drops.append((cid, self._records[cid].last_request))
            total -= sizes[cid]
        for cid, _ in drops:
            if cid in self._records:
                self._records[cid].kept = False
        return drops


def partial_until(params: dict[str, Any]) -> int:
    """A partial turn's ``prefill_until_s`` (0: the request answers)."""
    return int(params.get(PARTIAL_PARAM) or 0)
