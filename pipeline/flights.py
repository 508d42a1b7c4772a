"""The coordinator's records of one request in flight and of one abort awaiting acks, and the
errors its client API raises.

Both records are owned by the coordinator, on its event loop: a ``Flight`` from ``stream`` until
its last chunk, its failure or its abort; a ``PendingAbort`` from the broadcast until every stage
acknowledged (or the abort timeout).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pipeline.proto import Abort, OutputChunk


class PipelineError(RuntimeError):
    """A request failed in a stage (or the pipeline cannot serve)."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.message = message


class PipelineOverloaded(RuntimeError):
    """More than ``max_in_flight`` requests, or more than its owner's share (``admission``):
    rejected at once rather than queued without bound."""


@dataclass
class Flight:
    chunks: asyncio.Queue[OutputChunk | PipelineError | None] = field(default_factory=asyncio.Queue)
    pending_terminals: set[str] = field(default_factory=set)
    finished: bool = False
    outcome: str = "aborted"
    """How it ended: ``done`` (every terminal completed), ``failed`` or ``aborted``."""
    keep_answer_tokens: int | None = None
    owner: str | None = None
    """The request's ``OmniRequest.owner`` (its share of ``max_in_flight``)."""

    def fail(self, error: PipelineError) -> bool:
        """End the stream with ``error``; False when it had ended already."""
        if self.finished:
            return False
        self.finished = True
        self.outcome = "failed"
        self.chunks.put_nowait(error)
        return True


@dataclass
class PendingAbort:
    pending: set[str]
    started: float
    message: Abort
    """What was broadcast (sent again when acks may have been lost)."""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    kept_by: dict[str, str | None] = field(default_factory=dict)
    """Per stage that keeps conversations: what its AbortAck says the kept state ends with."""
