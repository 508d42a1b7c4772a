"""A bare aiortc peer per call: aiortc's own CPU floor, measured beside the server.

``python -m evaluation.bare_peer`` answers offers in one process of its own, one line of JSON
``{"sdp": offer}`` in on stdin and one line ``{"sdp": answer}`` out per call: an
``RTCPeerConnection`` with aiortc's own silence track (its encoder, its audio-level loop) and the
inbound track read and dropped. :func:`bare_peers` starts that process for a benchmark and
stops it (closing stdin) when done; its peers live until then.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import AudioStreamTrack, MediaStreamError, MediaStreamTrack

from evaluation.bench_common import ROOT
from harness.peers import LOOPBACK


async def serve() -> None:
    """One line of JSON {"sdp": offer} in on stdin, one line {"sdp": answer} out, per call."""
    loop = asyncio.get_running_loop()
    peers: list[RTCPeerConnection] = []
    readers: list[asyncio.Task[None]] = []

    async def drain(track: MediaStreamTrack) -> None:
        while True:
            try:
                await track.recv()
            except MediaStreamError:
                return

    while line := await loop.run_in_executor(None, sys.stdin.readline):
        offer = json.loads(line)["sdp"]
        pc = RTCPeerConnection(LOOPBACK.configuration())
        pc.on("track", lambda track: readers.append(asyncio.create_task(drain(track))))
        await pc.setRemoteDescription(RTCSessionDescription(LOOPBACK.filter_candidates(offer), "offer"))
        pc.addTrack(AudioStreamTrack())
        LOOPBACK.restrict(pc)
        await pc.setLocalDescription(await pc.createAnswer())
        peers.append(pc)
        print(json.dumps({"sdp": pc.localDescription.sdp}), flush=True)
    for pc in peers:
        await pc.close()


class BarePeers:
    """The bare-peer process, answering offers as ``ClientPeer.connect`` asks (``answer``)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.pid = process.pid

    async def answer(self, offer_sdp: str) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write((json.dumps({"sdp": offer_sdp}) + "\n").encode())
        await self.process.stdin.drain()
        return json.loads(await self.process.stdout.readline())["sdp"]


@asynccontextmanager
async def bare_peers() -> AsyncIterator[BarePeers]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "evaluation.bare_peer", cwd=ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        yield BarePeers(process)
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 20)
        except TimeoutError:
            process.kill()
            await process.wait()


if __name__ == "__main__":
    asyncio.run(serve())
