"""Multi-process transport: a ZMQ control plane over ipc:// sockets, tensors through shared memory.

Every endpoint binds two PULL sockets, ``ipc://{directory}/{name}`` and, for the urgent lane
(aborts and their acks, see ``pipeline.transport.inbox``), ``ipc://{directory}/{name}.urgent``,
so that an Abort does not queue behind data in the socket either; it keeps one PUSH socket per
target and lane it sends to. A wire message is three frames: kind (``m`` message, ``r`` release), the
sender's name, and the body (a pickle from ``ShmWriter`` or a segment name). After unpickling a
message the receiver sends ``r`` frames back to the sender, which then unlinks those segments.

A send that cannot be queued (ZMQ's high-water mark, 1000 messages a pipe by default: the target
does not read; or a full /dev/shm) raises SendError after giving back the segment it created. A
reader task that dies (its socket failed) makes ``recv`` raise ReaderDied; ``recv`` starts a new
reader for any that is not running.

Endpoints of one process (the stages of one process group, on one event loop) are ``neighbours``:
between them a message goes straight into the receiver's inbox, by reference, as the in-process
transport does; pickling and sockets cost ~0.4 ms of the loop's time a message, and the busiest
edge of a model (talker -> code2wav, one message a codec frame) usually stays inside a process.

Each endpoint owns an inbox (its messages, in order per sender and lane) and, once it receives, one
reader task per PULL socket that pumps it into that inbox and applies releases; ``close`` stops them.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import zmq
import zmq.asyncio

from pipeline.proto import ControlMessage
from pipeline.transport.base import SendError
from pipeline.transport.inbox import URGENT, Inbox
from pipeline.transport.shm import ShmWriter, loads

log = logging.getLogger(__name__)

_MESSAGE = b"m"
_RELEASE = b"r"
_LANES = ("", ".urgent")
"""Socket name suffixes: the ordinary lane, then the urgent one."""


def address(directory: Path, name: str, lane: str = "") -> str:
    return f"ipc://{directory / name}{lane}"


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
        context = zmq.asyncio.Context.instance()
        self._pulls: dict[str, zmq.asyncio.Socket] = {}
        for lane in _LANES:
            self._pulls[lane] = context.socket(zmq.PULL)
            self._pulls[lane].bind(address(directory, name, lane))
        # Sends are synchronous and never block (NOBLOCK): a plain socket needs no awaiting.
        self._push_ctx = zmq.Context.instance()
        self._push: dict[tuple[str, str], zmq.Socket] = {}
        self._writer = ShmWriter(shm_threshold)
        self._name_bytes = name.encode()
        self._inbox = Inbox()
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._closed = False
        self._neighbours = neighbours if neighbours is not None else {}
        self._neighbours[name] = self

    def _socket(self, target: str, lane: str) -> zmq.Socket:
        sock = self._push.get((target, lane))
        if sock is None:
            sock = self._push_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address(self._directory, target, lane))
            self._push[(target, lane)] = sock
        return sock

    def send(self, target: str, message: ControlMessage) -> None:
        neighbour = self._neighbours.get(target)
        if neighbour is not None:
            neighbour._inbox.put(message)
            return
        try:
            body, segment = self._writer.dump(message)
        except OSError as err:
            raise SendError(f"{self.name} -> {target}: no shared memory for it: {err}") from err
        lane = _LANES[1] if isinstance(message, URGENT) else _LANES[0]
        try:
            self._send_frames(target, lane, [_MESSAGE, self._name_bytes, body])
        except SendError:
            if segment is not None:
                self._writer.release(segment)  # nobody will ever acknowledge it
            raise

    def _send_frames(self, target: str, lane: str, frames: list[bytes]) -> None:
        try:
            self._socket(target, lane).send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise SendError(
                f"{self.name} -> {target}: its queue is full (the receiver is gone or not reading)"
            ) from None
        except zmq.ZMQError as err:
            raise SendError(f"{self.name} -> {target}: {err}") from err

    async def recv(self) -> ControlMessage:
        for lane, sock in self._pulls.items():
            reader = self._readers.get(lane)
            if reader is None or reader.done():
                reader = asyncio.create_task(self._read(sock), name=f"endpoint-{self.name}{lane}")
                reader.add_done_callback(self._on_reader_done)
                self._readers[lane] = reader
        return await self._inbox.get()

    def _on_reader_done(self, reader: asyncio.Task[None]) -> None:
        if self._closed:
            return
        # A reader only ends by close(): anything else (its socket failed, it was cancelled by
        # something else) leaves messages unread, and the owner must hear of it, not wait forever.
        error = reader.exception() if not reader.cancelled() else asyncio.CancelledError()
        log.error("endpoint %s: reader %s died: %r", self.name, reader.get_name(), error)
        self._inbox.fail(error or RuntimeError("reader ended"))

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            self._take(await sock.recv_multipart())
            # A recv that finds a message ready does not yield: without this, a backlog would be
            # drained whole before the urgent lane's reader (or the endpoint's owner) runs.
            await asyncio.sleep(0)

    def _take(self, frames: list[bytes]) -> None:
        """One wire message; a bad one is dropped and never stops the reader."""
        try:
            kind, sender, body = frames
            if kind == _RELEASE:
                self._writer.release(body.decode())
                return
            message, segments = loads(body)
        except Exception:  # noqa: BLE001 - e.g. a segment its dead sender's runner unlinked
            log.exception("endpoint %s: unreadable message dropped", self.name)
            return
        for segment in segments:
            try:
                self._send_frames(sender.decode(), "", [_RELEASE, self._name_bytes, segment.encode()])
            except SendError as err:
                # The sender frees it when it closes (or its runner, when it died).
                log.warning("endpoint %s: release of %s not sent: %s", self.name, segment, err)
        self._inbox.put(message)

    def shm_bytes(self) -> int:
        return self._writer.bytes_held

    def close(self, linger_ms: int = 0) -> None:
        """Close the sockets (waiting up to ``linger_ms`` to deliver what is queued) and free shm."""
        self._closed = True
        if self._neighbours.get(self.name) is self:
            del self._neighbours[self.name]
        for reader in self._readers.values():
            reader.cancel()
        for sock in self._push.values():
            sock.close(linger=linger_ms)
        self._push.clear()
        for sock in self._pulls.values():
            sock.close(linger=0)
        self._writer.close()
