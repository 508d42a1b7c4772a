"""Multi-process transport: a ZMQ control plane over ipc:// sockets, tensors through shared memory.

Every endpoint binds one PULL socket at ``ipc://{directory}/{name}`` and keeps one PUSH socket per
target it sends to. A wire message is three frames: kind (``m`` message, ``r`` release), the
sender's name, and the body (a pickle from ``ShmWriter`` or a segment name). After unpickling a
message the receiver sends ``r`` frames back to the sender, which then unlinks those segments.

Endpoints of one process (the stages of one process group, on one event loop) are ``neighbours``:
between them a message goes straight into the receiver's inbox, by reference, as the in-process
transport does; pickling and sockets cost ~0.4 ms of the loop's time a message, and the busiest
edge of a model (talker -> code2wav, one message a codec frame) usually stays inside a process.

Each endpoint owns an inbox (its messages, in order per sender) and, once it receives, a task that
pumps its socket into that inbox and applies releases; ``close`` stops the task.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import zmq
import zmq.asyncio

from pipeline.proto import ControlMessage
from pipeline.transport.shm import ShmWriter, loads

log = logging.getLogger(__name__)

_MESSAGE = b"m"
_RELEASE = b"r"


def address(directory: Path, name: str) -> str:
    return f"ipc://{directory / name}"


class ZmqEndpoint:
    """One endpoint of one process; owns its sockets and the shared memory of what it sent.

    ``neighbours``: the endpoints of this process and event loop, by name, shared by all of them
    (this endpoint adds itself); None for an endpoint that reaches every peer through its socket.
    """

    def __init__(
        self,
        name: str,
        directory: Path,
        shm_threshold: int,
        neighbours: dict[str, ZmqEndpoint] | None = None,
    ) -> None:
        self.name = name
        self._directory = directory
        self._pull = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._pull.bind(address(directory, name))
        # Sends are synchronous and never block (NOBLOCK): a plain socket needs no awaiting.
        self._push_ctx = zmq.Context.instance()
        self._push: dict[str, zmq.Socket] = {}
        self._writer = ShmWriter(shm_threshold)
        self._name_bytes = name.encode()
        self._inbox: asyncio.Queue[ControlMessage] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None
        self._neighbours = neighbours if neighbours is not None else {}
        self._neighbours[name] = self

    def _socket(self, target: str) -> zmq.Socket:
        sock = self._push.get(target)
        if sock is None:
            sock = self._push_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address(self._directory, target))
            self._push[target] = sock
        return sock

    def send(self, target: str, message: ControlMessage) -> None:
        neighbour = self._neighbours.get(target)
        if neighbour is not None:
            neighbour._inbox.put_nowait(message)
            return
        body = self._writer.dumps(message)
        self._send_frames(target, [_MESSAGE, self._name_bytes, body])

    def _send_frames(self, target: str, frames: list[bytes]) -> None:
        try:
            self._socket(target).send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            # The receiver is gone or hopelessly behind; what we lifted is freed at close.
            log.error("endpoint %s: %s is not receiving; message dropped", self.name, target)

    async def recv(self) -> ControlMessage:
        if self._pump is None:
            self._pump = asyncio.create_task(self._pump_socket(), name=f"endpoint-{self.name}")
        return await self._inbox.get()

    async def _pump_socket(self) -> None:
        while True:
            kind, sender, body = await self._pull.recv_multipart()
            if kind == _RELEASE:
                self._writer.release(body.decode())
                continue
            try:
                message, segments = loads(body)
            except Exception:  # noqa: BLE001 - e.g. a segment its dead sender's runner unlinked
                log.exception("endpoint %s: unreadable message from %s dropped", self.name, sender)
                continue
            for segment in segments:
                self._send_frames(sender.decode(), [_RELEASE, self._name_bytes, segment.encode()])
            self._inbox.put_nowait(message)

    def shm_bytes(self) -> int:
        return self._writer.bytes_held

    def close(self, linger_ms: int = 0) -> None:
        """Close the sockets (waiting up to ``linger_ms`` to deliver what is queued) and free shm."""
        if self._neighbours.get(self.name) is self:
            del self._neighbours[self.name]
        if self._pump is not None:
            self._pump.cancel()
        for sock in self._push.values():
            sock.close(linger=linger_ms)
        self._push.clear()
        self._pull.close(linger=0)
        self._writer.close()
