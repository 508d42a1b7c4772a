"""The scheduler contract: what a stage drives, and what each kind of model runner provides.

A stage owns exactly one scheduler and drives it from one worker thread: it hands over inputs
(``add``, ``feed``, ``close_stream``), aborts (``abort``) and calls ``step`` while ``has_work``.
The scheduler therefore needs no locks. It owns every piece of per-request state of its stage
(KV slots, streaming state, pending inputs) from the first input of a request until the request's
final output, its failure or its abort, and ``live_requests`` counts exactly that state.

Three schedulers implement the contract (``simple``, ``ar``, ``vocoder``); each drives a model
runner of its own shape (``BatchRunner``, ``ARRunner``, ``VocoderRunner``), built by a stage factory
in ``pipeline/models/``. The stage never asks which scheduler or runner it has.

One optional capability (``ConversationScheduler``): a scheduler may keep per-conversation state
between requests (the ``ar`` scheduler does when its runner is a ``ConversationRunner``: the
thinker's KV cache). Such state is not per-request state: it outlives its requests, is owned by the
scheduler's ``KeptConversations`` (``conversations.py``) and is freed by ``drop_conversation``
(session closed, evicted) or replaced by the conversation's next request. ``simple`` and
``vocoder`` answer its methods as no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pipeline.proto import StagePayload


@dataclass
class StageOutput:
    """One output of a step: a stream chunk (``final=False``) or the request's last output."""

    request_id: str
    data: dict[str, Any]
    final: bool = False


@dataclass
class RequestFailure:
    """A step failed one request; its state is already released when this is returned."""

    request_id: str
    error: str


StepResult = StageOutput | RequestFailure


class RequestError(Exception):
    """Raised by a runner for an error that belongs to one request, not to the whole batch."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


def describe_error(err: BaseException) -> str:
    """The message a client sees for a failed request: a RequestError's own words, else the type."""
    if isinstance(err, RequestError):
        return str(err)
    return f"{type(err).__name__}: {err}"


@runtime_checkable
class Scheduler(Protocol):
    def add(self, payload: StagePayload) -> None:
        """A whole input for a request (entry or a ``next`` edge; fan-in is already merged)."""

    def feed(self, payload: StagePayload) -> None:
        """One chunk of a streamed input, in order; the first chunk of a request starts it."""

    def close_stream(self, payload: StagePayload) -> None:
        """The streamed input of a request has ended; ``payload.data`` may carry final data."""

    def abort(self, request_id: str) -> None:
        """Release everything held for ``request_id``. Idempotent; unknown ids are fine."""

    def has_work(self) -> bool:
        """Whether ``step`` would do anything now."""

    def step(self) -> list[StepResult]:
        """Run one unit of compute for every runnable request (one batch)."""

    def live_requests(self) -> int:
        """Requests that hold state in this scheduler now."""

    def queue_depth(self) -> int:
        """Inputs waiting to be computed."""


@runtime_checkable
class ConversationScheduler(Protocol):
    """The optional capability of a Scheduler: per-conversation state kept between requests."""

    keeps_conversations: bool
    """Whether this scheduler keeps per-conversation state (requests that name a conversation)."""

    caches_conversations: bool
    """Whether its runner caches per-conversation work it can always redo (``ConversationCache``):
    nothing depends on it, and it is dropped with the conversation."""

    def abort_conversation(
        self, request_id: str, conversation_id: str, keep_answer_tokens: int | None
    ) -> str | None:
        """Abort a request of a conversation, in flight here or already finished here.

        The conversation's kept state goes back to what it was before the request
        (``keep_answer_tokens`` None) or keeps the request's prompt and its first
        ``keep_answer_tokens`` answer tokens (barge-in: what the user heard; only if the request
        had begun here). Idempotent. Returns the request whose turn the kept state now ends with
        (None: nothing kept), so the coordinator knows whether the turn was kept.
        """

    def drop_conversation(self, conversation_id: str, request_id: str | None) -> None:
        """Free a conversation's kept state; with ``request_id``, only if that request made it."""

    def conversation_sizes(self) -> dict[str, int]:
        """Bytes of kept state per conversation id (empty without the capability)."""


def conversation_keeper(scheduler: Scheduler) -> ConversationScheduler | None:
    """The scheduler as a ConversationScheduler, or None when it has no such methods (a scheduler
    written before the capability existed still serves, keeping nothing)."""
    return scheduler if isinstance(scheduler, ConversationScheduler) else None


# --- runners: what pipeline/models/ provides for each scheduler ------------------------------


@dataclass
class BatchItem:
    """One unit of work for a BatchRunner: a whole input, or one chunk of a streamed input."""

    payload: StagePayload
    final: bool


class BatchRunner(Protocol):
    """Stateless compute (``simple`` scheduler): one output per item, in the same order."""

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]: ...


@dataclass
class ARSlot:
    """One request in an autoregressive scheduler; owned by the scheduler, keyed by request_id.

    ``state`` is the runner's per-request state (its KV cache, counters); the scheduler hands it
    back to ``ARRunner.release`` when the request finishes, fails or is aborted. ``steps`` counts
    the steps that emitted output; ``cap`` is the output cap from the stage config and the request's
    params, before the runner's own ``output_cap``.
    """

    request_id: str
    params: dict[str, Any]
    state: Any
    cap: int
    steps: int = 0
    input_closed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ARStepResult:
    """What one step produced for one slot: output data to stream (or None) and whether it ended."""

    data: dict[str, Any] | None
    finished: bool = False


class ARRunner(Protocol):
    """Autoregressive compute (``ar`` scheduler): prefill then decode, one step for a whole batch."""

    def new_state(self, payload: StagePayload) -> Any:
        """Per-request state for a new request (no compute needed yet)."""

    def feed(self, slot: ARSlot, payload: StagePayload) -> None:
        """A streamed input chunk (e.g. the thinker's next token for the talker)."""

    def close_input(self, slot: ARSlot, payload: StagePayload) -> None:
        """The streamed input ended; ``payload.data`` may carry final data."""

    def runnable(self, slot: ARSlot) -> bool:
        """Whether the slot has every input its next step needs."""

    def output_cap(self, slot: ARSlot) -> int | None:
        """A model-specific cap on output steps (e.g. talker frames tied to text length), or None."""

    def step(self, slots: list[ARSlot]) -> list[ARStepResult]:
        """One forward for the batch (prefill for new slots, decode for the others)."""

    def finish(self, slot: ARSlot, capped: bool) -> dict[str, Any] | None:
        """Final data when the request ends (``capped``: it hit its cap); None for no extra chunk."""

    def release(self, slot: ARSlot) -> None:
        """Free the slot's KV cache and state."""


@runtime_checkable
class ConversationRunner(Protocol):
    """An ARRunner that can keep a request's state for its conversation's next request.

    ``kept`` objects are the runner's (KV cache, token ids, positions); the scheduler stores them
    between requests and hands each back exactly once (to ``resume``, ``truncate`` or ``drop``).
    """

    def resume(self, kept: Any, payload: StagePayload) -> Any:
        """Per-request state continuing ``kept``: the payload holds only what is new. Raises
        before taking ``kept`` over when the payload is bad (``kept`` is then still valid)."""

    def started(self, slot: ARSlot) -> bool:
        """Whether the request has added anything to its state yet (e.g. its prefill ran)."""

    def keep(self, slot: ARSlot) -> Any:
        """Take the slot's state as it stands (prompt and answer so far) out of the slot, as a
        kept object that also knows what it was before this request; ``release`` follows."""

    def truncate(self, kept: Any, answer_tokens: int | None) -> Any | None:
        """``kept`` with its last request undone (None) or its last answer cut to ``answer_tokens``
        tokens; None when nothing is left."""

    def kept_bytes(self, kept: Any) -> int:
        """Memory held by ``kept``."""

    def drop(self, kept: Any) -> None:
        """Free ``kept``."""


@runtime_checkable
class ConversationCache(Protocol):
    """An ARRunner that caches per-conversation work between requests which it can always redo
    (the talker's KV of earlier user turns). Unlike a ConversationRunner's state, no request needs
    it to be there, so it has no say in what a conversation holds; it is freed with the
    conversation (``drop_cached``) and counted with kept state."""

    def cached_conversations(self) -> dict[str, int]:
        """Bytes cached per conversation."""

    def drop_cached(self, conversation_id: str) -> None:
        """Free what is cached for a conversation (idempotent)."""


class NoConversations:
    """The conversation methods of a scheduler that keeps none (``simple``, ``vocoder``)."""

    keeps_conversations = False
    caches_conversations = False

    def abort_conversation(
        self, request_id: str, conversation_id: str, keep_answer_tokens: int | None
    ) -> str | None:
        self.abort(request_id)  # type: ignore[attr-defined]
        return None

    def drop_conversation(self, conversation_id: str, request_id: str | None) -> None:
        return None

    def conversation_sizes(self) -> dict[str, int]:
        return {}


class VocoderRunner(Protocol):
    """Streaming decode with causal state (``vocoder`` scheduler)."""

    def new_state(self, payload: StagePayload) -> Any:
        """Per-request causal state (convolution histories, attention cache)."""

    def decode(self, state: Any, chunks: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        """Decode the pending chunks (may be empty when ``final``) and return output data."""

    def release(self, state: Any) -> None:
        """Free the causal state."""
