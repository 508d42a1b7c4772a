"""The control-plane endpoint contract shared by the in-process and multi-process transports.

Each stage and the coordinator own one Endpoint for their whole life: they receive every message
addressed to their name and send to others by name. Messages to one target arrive in the order they
were sent. An endpoint owns whatever it allocated to carry a message (shared memory) until the
receiver has taken it; ``close`` frees all of it.
"""

from __future__ import annotations

from typing import Protocol

from pipeline.proto import ControlMessage


class Endpoint(Protocol):
    name: str

    async def recv(self) -> ControlMessage:
        """The next message addressed to this endpoint."""

    def send(self, target: str, message: ControlMessage) -> None:
        """Queue ``message`` for ``target``; never blocks on the receiver."""

    def shm_bytes(self) -> int:
        """Shared memory this endpoint holds for messages not yet taken by their receivers."""

    def close(self, linger_ms: int = 0) -> None:
        """Stop receiving and free everything this endpoint holds (``linger_ms``: time to deliver)."""
