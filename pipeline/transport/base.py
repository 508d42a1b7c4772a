"""The control-plane endpoint contract shared by the in-process and multi-process transports.

Each stage and the coordinator own one Endpoint for their whole life: they receive every message
addressed to their name and send to others by name. Messages to one target arrive in the order they
were sent, except that aborts and their acknowledgements overtake other messages (an urgent lane,
``pipeline.transport.inbox``). An endpoint owns whatever it allocated to carry a message (shared
memory) until the receiver has taken it; ``close`` frees all of it.

Faults are raised, never swallowed: ``send`` raises SendError when a message cannot be queued
(after freeing what it allocated for it), and ``recv`` raises ReaderDied when the reader of the
endpoint's socket failed; the owner of the endpoint decides what that costs (a request, a stage).
"""

from __future__ import annotations

from typing import Protocol

from pipeline.proto import ControlMessage


class SendError(RuntimeError):
    """A message could not be queued for its target: shared memory is full, or the target's queue
    is at its high-water mark (the target does not read). Nothing of the message was kept."""


class ReaderDied(RuntimeError):
    """The task that reads an endpoint's socket failed: messages may have been lost. The next
    ``recv`` starts a new reader (where the transport has one to restart)."""


class Endpoint(Protocol):
    name: str

    async def recv(self) -> ControlMessage:
        """The next message addressed to this endpoint; raises ReaderDied (see above)."""

    def send(self, target: str, message: ControlMessage) -> None:
        """Queue ``message`` for ``target``; never blocks on the receiver; raises SendError."""

    def shm_bytes(self) -> int:
        """Shared memory this endpoint holds for messages not yet taken by their receivers."""

    def close(self, linger_ms: int = 0) -> None:
        """Stop receiving and free everything this endpoint holds (``linger_ms``: time to deliver)."""
