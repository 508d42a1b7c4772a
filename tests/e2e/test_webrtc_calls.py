"""End to end over WebRTC: a real server process (toy preset, stage processes), real aiortc client
peers, real silero-vad, speech from espeak-ng. Runs in the loopback-only namespace."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from aiortc import RTCSessionDescription

from tests.duplex.peers import ClientPeer
from tests.e2e.mic import ScriptedMic
from tests.server import ServerProcess, run_server, write_preset
from tests.speech import speech

QUESTION = "Hello there. Could you tell me what the weather will be like tomorrow?"
INTERRUPTION = "Wait, stop, I have another question for you right now."
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("webrtc")
    preset = write_preset(tmp / "preset.yaml", session={"inbound_media_timeout_s": 3.0})
    with run_server(preset, tmp=tmp) as running:
        yield running


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


async def open_call(server: ServerProcess) -> Call:
    mic = ScriptedMic()
    peer = ClientPeer(mic)
    offer = await peer.offer()
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{server.url}/v1/realtime/calls", content=offer,
                                 headers={"Content-Type": "application/sdp"}, timeout=TIMEOUT)
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


async def wait_stages_idle(server: ServerProcess) -> None:
    stages = ["thinker", "decode", "talker", "code2wav"]
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while True:
        live = {s: server.metric("pipeline_stage_live_requests", {"stage": s}) for s in stages}
        if not any(live.values()) and server.metric("pipeline_requests_active") == 0:
            return
        assert asyncio.get_running_loop().time() < deadline, live
        await asyncio.sleep(0.25)  # the gauges arrive with the stages' periodic stats


async def test_spoken_question_gets_a_spoken_answer(server: ServerProcess) -> None:
    call = await open_call(server)
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    done = await call.wait_event("response.done")
    assert done["response"]["status"] == "completed"
    stopped = await call.wait_event("output_audio_buffer.stopped")
    assert stopped["response_id"] == done["response"]["id"]
    assert_subsequence(call.types(), [
        "session.created", "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed", "conversation.item.added", "response.created",
        "response.output_audio_transcript.delta", "output_audio_buffer.started",
        "response.output_audio_transcript.done", "response.done", "output_audio_buffer.stopped",
    ])
    types = call.types()
    assert types.index("response.output_audio_transcript.delta") < types.index("output_audio_buffer.started")
    transcript = done["response"]["output"][0]["content"][0]["transcript"]
    assert transcript.strip(), done
    started_at = next(t for t, s, _ in call.peer.frames if np.abs(s).max() > 0.05)
    assert call.energy_between(started_at, started_at + 2.0) > 0.05
    assert server.metric("duplex_turns_total") >= 1
    await hang_up(server, call)
    await wait_stages_idle(server)
