"""In-process transport: one asyncio queue per endpoint, all endpoints on one event loop.

Messages travel by reference: tensors are not copied, so a sender must not mutate what it sent.
Used by tests, benchmarks and small presets; serving defaults to the multi-process transport so that
model compute never shares a GIL with the loop that paces audio.
"""

from __future__ import annotations

from pipeline.proto import ControlMessage
from pipeline.transport.inbox import Inbox


class InprocHub:
    """Owns the inboxes of every endpoint of one pipeline; lives as long as the pipeline."""

    def __init__(self) -> None:
        self._queues: dict[str, Inbox] = {}

    def endpoint(self, name: str) -> InprocEndpoint:
        if name in self._queues:
            raise ValueError(f"endpoint {name!r} already exists")
        self._queues[name] = Inbox()
        return InprocEndpoint(name, self)

    def deliver(self, target: str, message: ControlMessage) -> None:
        queue = self._queues.get(target)
        if queue is not None:
            queue.put(message)

    def remove(self, name: str) -> None:
        self._queues.pop(name, None)

    def queue(self, name: str) -> Inbox:
        return self._queues[name]


class InprocEndpoint:
    def __init__(self, name: str, hub: InprocHub) -> None:
        self.name = name
        self._hub = hub
        self._queue = hub.queue(name)

    async def recv(self) -> ControlMessage:
        return await self._queue.get()

    def send(self, target: str, message: ControlMessage) -> None:
        self._hub.deliver(target, message)

    def shm_bytes(self) -> int:
        return 0

    def close(self, linger_ms: int = 0) -> None:
        self._hub.remove(self.name)
