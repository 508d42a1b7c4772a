"""The multi-process transport between endpoints: neighbours (one process, one event loop) hand
messages over by reference; everyone else gets a copy through the socket, in order, and the
shared memory it rode comes back to its sender."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from pipeline.proto import StagePayload, StreamChunk
from pipeline.transport.zmq_ipc import ZmqEndpoint


def chunk(seq: int, floats: int) -> StreamChunk:
    return StreamChunk(StagePayload("req", {"x": torch.full((floats,), float(seq))}), "a", seq)


async def test_neighbours_share_messages_and_others_get_ordered_copies(directory: Path) -> None:
    neighbours: dict[str, ZmqEndpoint] = {}
    a = ZmqEndpoint("a", directory, 1024, neighbours)
    b = ZmqEndpoint("b", directory, 1024, neighbours)
    c = ZmqEndpoint("c", directory, 1024)  # another process, as far as a and b know
    releases = asyncio.create_task(a.recv())  # receiving applies the releases sent back to a
    try:
        sent = [chunk(seq, floats=4 if seq % 2 else 4096) for seq in range(50)]
        for message in sent:
            a.send("b", message)
            a.send("c", message)
        async with asyncio.timeout(10):
            assert [await b.recv() for _ in sent] == sent  # the very same objects
            copies = [await c.recv() for _ in sent]
        assert [m.seq for m in copies] == list(range(50))
        for copy, message in zip(copies, sent, strict=True):
            assert copy is not message
            assert torch.equal(copy.payload.data["x"], message.payload.data["x"])
        deadline = time.monotonic() + 10
        while a.shm_bytes():  # the 16 KiB chunks rode shared memory; c released every one
            assert time.monotonic() < deadline, "shared memory never released"
            await asyncio.sleep(0.01)
    finally:
        releases.cancel()
        for endpoint in (a, b, c):
            endpoint.close()
    assert neighbours == {}
