"""A recorded WebRTC call with a barge-in: the app in this process (httpx's ASGI transport), the
toy pipeline in-process, a real aiortc client peer whose microphone plays espeak speech."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
from aiortc import RTCSessionDescription

from duplex.app import create_app
from duplex.settings import load_preset
from duplex.transports.webrtc.ice import IcePolicy
from harness.mic import ScriptedMic
from harness.peers import ClientPeer
from harness.server import write_preset
from harness.speech import speech
from pipeline.runner import start_pipeline
from tests.operators.conftest import toy_pipeline
from tests.operators.recordings import events, read, runs

QUESTION = "Hello there. Could you tell me what the weather will be like tomorrow?"
INTERRUPTION = "Wait, stop, I have another question."


def audible(frames: list[tuple[float, np.ndarray, int]]) -> int:
    return sum(1 for _, samples, _ in frames if np.abs(samples).max() > 0.02)


async def test_webrtc_recording_cuts_the_agent_where_the_caller_stopped_hearing(tmp_path: Path) -> None:
    folder = tmp_path / "calls"
    path = write_preset(tmp_path / "preset.yaml", pipeline=toy_pipeline(40), record_dir=str(folder))
    preset = load_preset(["--config", str(path)], environ={})
    app = create_app(preset, IcePolicy(hosts=("127.0.0.1",)))
    state = app.state.duplex
    state.pipeline = await start_pipeline(preset.pipeline, mode="inproc")
    mic = ScriptedMic()
    peer = ClientPeer(mic)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
            answer = await http.post("/v1/realtime/calls", content=await peer.offer(),
                                     headers={"Content-Type": "application/sdp"})
            assert answer.status_code == 201
            call_id = answer.headers["location"].rsplit("/", 1)[1]
            await peer.pc.setRemoteDescription(
                RTCSessionDescription(peer.policy.filter_candidates(answer.text), "answer"))
            await peer.wait_for(lambda: any(e["type"] == "session.created" for e in peer.events()))
            await mic.say(speech(QUESTION, 48000, 0.3, 0.0))
            # The agent answers (9.6 s of audio); the caller hears 1.5 s of it, then cuts in.
            await peer.wait_for(lambda: audible(peer.frames) >= 75)
            await mic.say(speech(INTERRUPTION, 48000, 0.0, 0.0))
            await peer.wait_for(lambda: any(e["type"] == "conversation.item.truncated" for e in peer.events()))
            heard_by_client = audible(peer.frames) * 0.02
            assert (await http.post(f"/v1/realtime/calls/{call_id}/hangup")).status_code == 200
    finally:
        await peer.close()
        await state.registry.close_all()
        await state.pipeline.close()
    wav, lines = read(folder, call_id)
    assert lines[0]["kind"] == "call" and lines[-1]["kind"] == "end"
    agent, caller = runs(wav[:, 1]), runs(wav[:, 0], gap_s=0.6)  # the question has a pause
    # The agent's channel: one stretch, as long as the caller heard (the truncation says so too).
    assert len(agent) == 1, agent
    truncated = events(lines, "conversation.item.truncated")[0]
    heard_s = agent[0][1] - agent[0][0]
    assert abs(heard_s - truncated["event"]["audio_end_ms"] / 1000) <= 0.06
    assert abs(heard_s - heard_by_client) <= 0.1
    # It ends where the caller cut in: after the onset (the server pauses within ~100 ms of it),
    # before the interruption was confirmed (speech_started goes out then, 200 ms of speech later).
    started = events(lines, "input_audio_buffer.speech_started")
    assert len(started) == 2 and len(caller) == 2, (started, caller)
    # (The caller's side is placed by arrival, kept continuous across 100 ms of jitter.)
    assert agent[0][1] <= started[1]["t"]
    assert abs(agent[0][1] - caller[1][0]) <= 0.25
    # The agent began after the caller's question ended, and its start is logged.
    answer_started = events(lines, "output_audio_buffer.started")[0]["t"]
    assert caller[0][1] < agent[0][0] and abs(agent[0][0] - answer_started) <= 0.06
    # The caller's speech is on the left at the times the events say: each speech_started within
    # the VAD's delay (and, over the agent, the 200 ms that confirm it) after its onset.
    for (onset, _), event in zip(caller, started, strict=True):
        assert 0 <= event["t"] - onset <= 0.45, (onset, event["t"])
    stopped = events(lines, "input_audio_buffer.speech_stopped")[0]
    assert 0.4 <= stopped["t"] - caller[0][1] <= 0.9  # 500 ms of silence end the turn
    # The transcript of the agent's side is there, cut to what was heard.
    said = [line for line in lines if line["kind"] == "transcript" and line["role"] == "assistant"]
    assert any(line.get("heard_ms") == truncated["event"]["audio_end_ms"] for line in said)
