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

import logging
from typing import Protocol

from pipeline.proto import ControlMessage

log = logging.getLogger(__name__)

LAST_WORDS_LINGER_MS = 2000
"""How long a closing endpoint gives ZMQ to deliver what it still queues (a stage's crash report)
before its process exits."""


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


def send_control(endpoint: Endpoint, target: str, message: ControlMessage, sender: str) -> bool:
    """Send a control message whose loss ends by its own timeout (an ack, a failure, stats, an
    abort); False, and a log line naming ``sender``, when it could not be queued."""
    try:
        endpoint.send(target, message)
    except SendError as err:
        rid = getattr(message, "request_id", None)
        log.error("%s: %s for request %s to %s lost: %s", sender, type(message).__name__, rid, target, err)
        return False
    return True
