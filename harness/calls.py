"""WebRTC calls against a running server, as a client sees them: open one, wait for its events,
measure the audio it received, hang up, and wait until the server's stages are idle again.

A Call belongs to the test or benchmark that opened it and lives until ``hang_up``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
from aiortc import RTCSessionDescription
from aiortc.mediastreams import MediaStreamTrack

from harness.mic import ScriptedMic
from harness.peers import ClientPeer
from harness.server import ServerProcess

TIMEOUT = 30.0
QUESTION = "Hello there. Could you tell me what the weather will be like tomorrow?"
INTERRUPTION = "Wait, stop, I have another question for you right now."


class Call:
    """One client call: the peer, its microphone and the events it received."""

    def __init__(self, peer: ClientPeer, mic: ScriptedMic, call_path: str) -> None:
        self.peer = peer
        self.mic = mic
        self.path = call_path

    def events(self) -> list[dict[str, Any]]:
        return self.peer.events()

    def types(self) -> list[str]:
        return [e["type"] for e in self.events()]

    async def wait_event(self, kind: str, count: int = 1, **match: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            hits = [e for e in self.events() if e["type"] == kind
                    and all(_get(e, k) == v for k, v in match.items())]
            return hits[count - 1] if len(hits) >= count else None

        return await self.peer.wait_for(found, TIMEOUT)

    def energy_between(self, start: float, end: float) -> float:
        chunks = [s for t, s, _ in self.peer.frames if start <= t < end]
        return float(np.sqrt(np.mean(np.concatenate(chunks) ** 2))) if chunks else 0.0


def _get(event: dict[str, Any], dotted: str) -> Any:
    value: Any = event
    for part in dotted.split("__"):
        value = value.get(part) if isinstance(value, dict) else None
    return value


async def open_call(server: ServerProcess, video: MediaStreamTrack | None = None) -> Call:
    """A WebRTC call to ``server`` (with ``video`` as its camera, where given), its events
    channel open and ``session.created`` in."""
    mic = ScriptedMic()
    peer = ClientPeer(mic, video=video)
    offer = await peer.offer()
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{server.url}/v1/realtime/calls", content=offer,
                                 headers={"Content-Type": "application/sdp"}, timeout=TIMEOUT)
    return await answered(peer, mic, answer)


async def answered(peer: ClientPeer, mic: ScriptedMic, answer: httpx.Response) -> Call:
    """The call that ``answer`` (the server's 201 to ``peer``'s offer) opens, its events channel
    open and ``session.created`` in."""
    assert answer.status_code == 201, answer.text
    assert answer.headers["content-type"].startswith("application/sdp")
    await peer.pc.setRemoteDescription(
        RTCSessionDescription(peer.policy.filter_candidates(answer.text), "answer"))
    peer.channel.on("open", peer.notify)
    await peer.wait_for(lambda: peer.channel.readyState == "open", TIMEOUT)
    call = Call(peer, mic, answer.headers["location"])
    await call.wait_event("session.created")
    return call


async def hang_up(server: ServerProcess, call: Call) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{server.url}{call.path}/hangup", timeout=TIMEOUT)
    assert response.status_code == 200
    await call.peer.close()


def assert_subsequence(types: list[str], expected: list[str]) -> None:
    it = iter(types)
    missing = [e for e in expected if not any(t == e for t in it)]
    assert not missing, f"{missing} not in order in {types}"


TOY_STAGES = ["thinker", "decode", "talker", "code2wav"]


async def wait_stages_busy(server: ServerProcess, stages: list[str] = TOY_STAGES) -> None:
    """Until every stage reports per-request state (a request is in every stage at once)."""
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while True:
        live = {s: server.metric("pipeline_stage_live_requests", {"stage": s}) for s in stages}
        if all(live.values()):
            return
        assert asyncio.get_running_loop().time() < deadline, live
        await asyncio.sleep(0.05)  # the gauges arrive with the stages' periodic stats


async def wait_stages_idle(server: ServerProcess, stages: list[str] = TOY_STAGES) -> None:
    """Until no stage holds per-request state and the coordinator has nothing in flight."""
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while True:
        live = {s: server.metric("pipeline_stage_live_requests", {"stage": s}) for s in stages}
        if not any(live.values()) and server.metric("pipeline_requests_active") == 0:
            return
        assert asyncio.get_running_loop().time() < deadline, live
        await asyncio.sleep(0.25)  # the gauges arrive with the stages' periodic stats


async def eventually(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Until ``condition()`` holds: for gauges of another process, which are reported periodically."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.25)


async def wait_metric(server: ServerProcess, name: str, at_least: float) -> None:
    """Until the server's metric ``name`` (no labels) reaches ``at_least``."""
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while (value := server.metric(name)) < at_least:
        assert asyncio.get_running_loop().time() < deadline, (name, value)
        await asyncio.sleep(0.05)


def audible_seconds(call: Call, since: float = 0.0) -> float:
    """Agent audio received so far (frames with signal), in seconds."""
    return sum(len(s) for t, s, _ in call.peer.frames if t >= since and np.abs(s).max() > 0.02) / 48000
