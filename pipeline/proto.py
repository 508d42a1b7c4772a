"""Messages of the pipeline: requests, payloads between stages, and control messages.

Every message is a frozen-ish dataclass. One serialisation mechanism serves them all: pickle for the
control plane, with tensors and arrays lifted out onto the data plane by the transport
(``pipeline.transport``); no class writes its own ``to_dict``.

Ownership: a message belongs to whoever holds it last. The transport that delivers a message across
processes owns the shared memory behind its tensors until the receiver has copied them out and
acknowledged (see ``pipeline.transport.shm``).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

COORDINATOR = "coordinator"
"""Endpoint name of the coordinator on the control plane; stages use their own names."""


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex[:16]}"


@dataclass
class OmniRequest:
    """One model request. Its ``request_id`` is fixed by whoever submits it and carried to the end.

    ``inputs`` holds what the model consumes, in one shape for every model and client:
    ``{"messages": [{"role": "system" | "user" | "assistant", "text": str | None,
    "audio": float32 mono ndarray | None, "sample_rate": int | None}, ...]}``, oldest first; the
    last message is the turn to answer. Function calling adds optional message fields: an
    assistant message's ``tool_calls`` (``[{"call_id", "name", "arguments"}]``, made after its own
    words ``words``: str | None) and a user message's ``tool_result`` (``{"call_id", "name",
    "output"}``); ``text`` then holds a plain rendering of them for models that read text only.
    ``params`` holds caps and options (``max_output_tokens``, ``voice``, ``modalities``: ["text"]
    or ["text", "audio"], ``tools`` and ``tool_choice`` as the Realtime API spells them, ...).
    The pipeline core never looks inside either; the entry stage of a model validates them.
    A model's function call comes out as chunks ``{"function_call": {"name", "arguments"}}``
    (``arguments``: the new text of the call's JSON arguments).
    """

    request_id: str
    inputs: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)
    owner: str | None = None
    """Who asks (a session id, an API client), for the fair share of ``max_in_flight``
    (``pipeline/admission.py``); None: bounded by ``max_in_flight`` only. Never sent to a stage."""


@dataclass
class StagePayload:
    """What flows between stages for one request: the request's params and this hop's data.

    ``data`` may hold torch tensors and numpy arrays; across processes they ride shared memory.
    """

    request_id: str
    data: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)


MergeFn = Callable[[dict[str, StagePayload]], StagePayload]
"""Fan-in: merges the payloads from each ``wait_for`` source (keyed by source stage) into one."""


@dataclass
class OutputChunk:
    """A piece of a terminal stage's output, as the coordinator hands it to clients.

    Well-known keys in ``data``: ``text`` (a text delta), ``audio`` (float32 mono samples),
    ``sample_rate`` (of ``audio``), ``token_ids``, ``usage``. ``final`` marks the stage's last chunk.
    A synthesis stage that knows which text an audio chunk voices says so (``spoken_text``); a
    recognising stage (or one it feeds) gives the user's words (``input_transcript``) and, where
    asked (``params["end_of_turn"]``), in the same chunk, the probability that they are a finished
    turn (``input_end_of_turn``); a model that calls a function gives the call in pieces as it writes
    it (``function_call``: ``{"name", "arguments"}``, the name and a delta of the arguments).
    Models that count the answer in tokens say so, so that a barge-in keeps the same answer tokens
    in the model's state and in the conversation's text: ``text_tokens``, how many answer tokens a
    text chunk's delta covers (the deltas of chunks covering the first n tokens are those tokens'
    text), and ``answer_tokens``, how many answer tokens (from the answer's start) the audio up to
    and including an audio chunk voiced, the n that ``abort(..., keep_answer_tokens=n)`` keeps.
    """

    request_id: str
    stage: str
    data: dict[str, Any]
    final: bool = False


class RecentIds:
    """The ``capacity`` most recently added request ids (a bounded set), oldest forgotten first.

    The coordinator and every stage keep one for requests that ended there, so that late data
    for them is dropped instead of recreating state. Owned by one thread.
    """

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, rid: object) -> bool:
        return rid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, rid: str) -> None:
        self._ids[rid] = None
        self._ids.move_to_end(rid)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)


# --- control messages -------------------------------------------------------------------------


@dataclass
class Submit:
    """A whole payload for ``target``'s scheduler: from the coordinator (entry) or a ``next`` edge."""

    payload: StagePayload
    source: str


@dataclass
class StreamChunk:
    """One piece of a stream from ``source`` (a ``stream_to`` edge, or a terminal to the coordinator)."""

    payload: StagePayload
    source: str
    seq: int


@dataclass
class StreamDone:
    """The end of ``source``'s stream for a request; ``payload`` may carry final data.

    Sent by a stage to its ``stream_to`` targets, and by a terminal stage to the coordinator, for
    which it means "this terminal completed the request".
    """

    payload: StagePayload
    source: str
    seq: int


@dataclass
class Failed:
    """A stage failed a request; the coordinator fails the whole request with this error."""

    request_id: str
    source: str
    error: str


@dataclass
class Abort:
    """Forget ``request_id`` everywhere. Idempotent; each stage answers with an AbortAck.

    For a request of a conversation whose state stages keep, ``conversation_id`` names it: the
    abort then also reaches a stage that already finished the request, and the kept state goes
    back to before the request, or (``keep_answer_tokens``) keeps the request's prompt and the
    first ``keep_answer_tokens`` tokens of its answer: what the user heard.
    """

    request_id: str
    conversation_id: str | None = None
    keep_answer_tokens: int | None = None


@dataclass
class DropConversation:
    """Free the state kept for a conversation (closed, evicted); with ``request_id``, only if
    that request made it (a late drop never hits newer state). Not acknowledged."""

    conversation_id: str
    request_id: str | None = None


@dataclass
class AbortAck:
    """``source`` holds no more state for ``request_id`` and will drop any late data for it.

    For an Abort naming a conversation, from a stage that keeps conversations: ``kept_by`` is the
    request whose turn the conversation's kept state now ends with (None: nothing is kept).
    """

    request_id: str
    source: str
    kept_by: str | None = None


@dataclass
class StatsRequest:
    """Ask a stage for a fresh StageStats; ``token`` pairs the reply with the question.

    ``fresh``: the counts after every command queued so far (the worker thread answers, between
    two steps). ``fresh=False`` (the coordinator's hang watch) asks for a sign of life only: the
    stage's event loop answers at once with the counts it has when its worker thread ran since
    the previous such question, so that a long step does not pass for a hang; else the worker
    answers, as for a fresh one (a worker blocked for good never does).
    """

    token: int
    fresh: bool = True


@dataclass
class StageStats:
    """A stage's live per-request state and timings, reported to the coordinator.

    ``step_seconds`` holds the compute-step durations since the previous report;
    ``conversations`` the bytes of state kept per conversation id (not per-request state).
    """

    source: str
    live_requests: int
    queue_depth: int
    shm_bytes: int = 0
    step_seconds: list[float] = field(default_factory=list)
    token: int | None = None
    conversations: dict[str, int] = field(default_factory=dict)


@dataclass
class Ready:
    """A stage has loaded its model and serves; ``keeps_conversations``: it can keep
    per-conversation state between requests (its scheduler has the capability);
    ``caches_conversations``: it caches per-conversation work that it frees with the conversation."""

    source: str
    keeps_conversations: bool = False
    caches_conversations: bool = False


@dataclass
class StageCrashed:
    """A stage could not start or its process died; the pipeline cannot serve."""

    source: str
    error: str


@dataclass
class Shutdown:
    """Stop serving and release everything."""


ControlMessage = (
    Submit
    | StreamChunk
    | StreamDone
    | Failed
    | Abort
    | DropConversation
    | AbortAck
    | StatsRequest
    | StageStats
    | Ready
    | StageCrashed
    | Shutdown
)
