"""What the Ray transport's two endpoints share: the wire format and the ordered link.

A batch of messages crosses Ray as one ``bytes`` argument (or return value): a pickle of
``[(origin, message), ...]`` made by the same mechanism as the process transport
(``pipeline.transport.shm``), with no tensor lifted into shared memory: torch tensors travel as
their raw bytes (torch's own pickling costs ~0.3 ms a tensor each way) and every tensor the
receiver unpickles is its own writable copy, as in the other transports. Ray carries a batch under
100 KiB inside the actor call itself and puts a bigger one into its object store (one copy in, a
zero-copy read on the receiving node, fetched across nodes); ``evaluation/ray_placement_bench.py``
measures both against an explicit ``ray.put``. ``origin`` names the front end a message's request
came from, so that a stage shared by several front ends answers the right one.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

from pipeline.proto import ControlMessage, StreamChunk, StreamDone, Submit
from pipeline.transport.shm import ShmWriter, loads

log = logging.getLogger(__name__)

Item = tuple[str | None, ControlMessage]
"""(origin front end or None, message)."""

_WRITER = ShmWriter(sys.maxsize)  # a threshold no tensor reaches: nothing is lifted, nothing held


def encode(items: list[Item]) -> bytes:
    return _WRITER.dumps(items)


def decode(data: bytes) -> list[Item]:
    items, _ = loads(data)
    return items


def request_id_of(message: ControlMessage) -> str | None:
    """The request a message is about (Submit, StreamChunk, Abort, ...), or None (Ready, stats)."""
    rid = getattr(message, "request_id", None)
    if rid is None:
        rid = getattr(getattr(message, "payload", None), "request_id", None)
    return rid


OnLost = Callable[[str, str], None]
"""``(request id, why)``: a request's data (Submit, StreamChunk, StreamDone) was not delivered."""


def _carried(batch: list[Item]) -> list[str]:
    """The requests whose data ``batch`` carries, once each, in order. Other messages (an abort,
    a stats question, a drop) end by their own timeouts when lost."""
    data = (Submit, StreamChunk, StreamDone)
    rids = (m.payload.request_id for _, m in batch if isinstance(m, data))
    return list(dict.fromkeys(rids))


class Link:
    """The batches one endpoint sends to one stage actor, one actor call at a time.

    Ray does not keep the calls to an async actor in order (a call whose argument is still being
    fetched from the object store is overtaken), and the stages need every sender's messages in
    order; so the next batch leaves only once the previous one was delivered. Messages queued
    meanwhile coalesce into that next batch, so a busy edge sends fewer, larger calls. A batch
    that could not be delivered (the target died or is away, or it could not be pickled) is
    dropped, and ``on_lost`` hears of every request whose data it carried, so that the request
    fails at once instead of waiting for the stream's idle timeout. Owned by one endpoint on one
    event loop until ``close``.
    """

    def __init__(self, target: str, handle: Callable[[], Any], on_lost: OnLost) -> None:
        self._target = target
        self._handle = handle
        self._on_lost = on_lost
        self._pending: list[Item] = []
        self._task: asyncio.Task[None] | None = None

    def push(self, item: Item) -> None:
        self._pending.append(item)
        if self._task is None:
            # Started on the next loop iteration: what this callback still sends joins the batch.
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await self._handle().deliver.remote(encode(batch))
                except Exception as err:  # noqa: BLE001 - RayError, or an unpicklable message
                    # Not raised: the link serves the next batch (the target may be back by then).
                    log.warning("%d messages to %s lost: %r", len(batch), self._target, err)
                    why = f"lost on the way to stage {self._target}: {type(err).__name__}: {err}"
                    for rid in _carried(batch):
                        self._on_lost(rid, why)
        finally:
            self._task = None

    async def drained(self) -> None:
        """Return once everything pushed so far was delivered (or lost)."""
        if self._task is not None:
            await asyncio.wait([self._task])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._pending = []
