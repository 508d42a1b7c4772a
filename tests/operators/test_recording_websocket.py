"""A recorded Realtime WebSocket call, end to end: a real ``python -m duplex.serve --record-dir``
(the toy preset) and a ``websockets`` client whose microphone streams espeak speech, then
silence, at real time (as a client's microphone does: the recording places the caller's audio by
its arrival), and that plays the agent's answer before it hangs up.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from harness.server import ServerProcess, run_server, write_preset
from harness.speech import speech
from tests.operators.conftest import toy_pipeline
from tests.operators.recordings import RATE, events, read, runs
from tests.operators.test_hang_up_e2e import (
    PCM_RATE,
    WsClient,
    audio_ms,
    connect,
    eventually,
    pcm16_b64,
    websocket_sessions,
)

ANSWER_WORDS = 6  # 6 words x 3 frames x 80 ms = 1.44 s of the agent's audio
MIC_CHUNK_MS = 20
QUESTION = "Hello there. Could you tell me what the weather will be like tomorrow?"
VAD_DELAY_S = 0.4  # speech_started within this of the onset
SILENCE_S = 0.5  # server_vad's silence_duration_ms: speech_stopped this long after the end
PLAYED_MARGIN_S = 0.3  # the client hangs up this long after the answer's audio played out


@pytest.fixture(scope="module")
def recording_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    tmp = tmp_path_factory.mktemp("recording")
    folder = tmp / "calls"
    preset = write_preset(tmp / "preset.yaml", pipeline=toy_pipeline(ANSWER_WORDS))
    with run_server(preset, "--record-dir", str(folder), tmp=tmp) as running:
        yield running, folder


async def microphone(client: WsClient, samples: np.ndarray, until: asyncio.Event) -> None:
    """Stream ``samples`` (24 kHz), then silence, in 20 ms chunks at real time, until ``until``;
    each chunk wakes the client's waiters (the call's time moved on). The sleeps pace a
    microphone; they synchronise nothing."""
    loop = asyncio.get_running_loop()
    step = PCM_RATE * MIC_CHUNK_MS // 1000
    silence = np.zeros(step, dtype=np.float32)
    began = loop.time()
    for i in itertools.count():
        if until.is_set() or client.ended:
            return
        piece = samples[i * step:(i + 1) * step] if i * step < len(samples) else silence
        await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(piece)})
        client.notify()
        await asyncio.sleep(max(0.0, began + (i + 1) * MIC_CHUNK_MS / 1000 - loop.time()))


async def test_websocket_call_is_recorded_both_sides_and_its_events(
        recording_server: tuple[ServerProcess, Path]) -> None:
    server, folder = recording_server
    question = speech(QUESTION, PCM_RATE, 0.5, 1.0)
    hang_up = asyncio.Event()
    loop = asyncio.get_running_loop()
    async with connect(server) as client:
        session_id = client.of("session.created")[0]["session"]["id"]
        mic = loop.create_task(microphone(client, question, hang_up))
        try:
            stopped = await client.wait_event("input_audio_buffer.speech_stopped")
            answer = await client.wait_event("response.created", client.index(stopped))
            answer_id = answer["response"]["id"]
            await client.wait_event("response.output_audio.delta", response_id=answer_id)
            heard_from = loop.time()  # the client began playing the answer about now
            await client.wait_done(answer_id)
            answer_s = audio_ms(client, answer_id) / 1000
            assert answer_s > 1.0
            # The client plays the answer at real time; it hangs up once that is over (its
            # microphone streams meanwhile, and wakes this wait at each chunk).
            await client.wait(lambda: loop.time() >= heard_from + answer_s + PLAYED_MARGIN_S,
                              "the answer to play out", timeout=answer_s + 5)
        finally:
            hang_up.set()
            await mic
        received = np.concatenate([
            np.frombuffer(base64.b64decode(e["delta"]), dtype="<i2")
            for e in client.of("response.output_audio.delta") if e["response_id"] == answer_id
        ]).astype(np.float32) / 32768
        deltas = [e["delta"] for e in client.of("response.output_audio.delta")]
        await client.ws.close()
    await eventually(lambda: websocket_sessions(server) == 0, "the session to end")

    wav, lines = read(folder, session_id)  # asserts 16 kHz, 16-bit, stereo
    call = lines[0]
    assert call["kind"] == "call" and call["t"] == 0.0, call
    assert (call["id"], call["transport"], call["rate"]) == (session_id, "websocket", RATE), call
    assert lines[-1]["kind"] == "end", lines[-1]
    assert all("t" in line for line in lines)
    times = [line["t"] for line in lines]
    assert times == sorted(times)

    # The server's events, with their times, in the order the client got them.
    logged = [line["event"]["type"] for line in lines if line["kind"] == "server"]
    got = [e["type"] for e in client.events]
    assert logged == got, (logged[:12], got[:12])
    started = events(lines, "input_audio_buffer.speech_started")
    stopped_line = events(lines, "input_audio_buffer.speech_stopped")
    assert len(started) == 1 and len(stopped_line) == 1, (started, stopped_line)
    created_t = next(l["t"] for l in events(lines, "response.created")
                     if l["event"]["response"]["id"] == answer_id)
    delta_lines = [l for l in events(lines, "response.output_audio.delta")
                   if l["event"]["response_id"] == answer_id]
    assert delta_lines and created_t <= delta_lines[0]["t"]

    # No audio in the log: the deltas by their length, the appends left out, and none of the
    # audio that travelled either way anywhere in the file.
    text = (folder / f"{session_id}.jsonl").read_text()
    assert all(l["event"]["delta"] == f"<{len(d)} base64 characters>" for l, d in zip(delta_lines, (
        e["delta"] for e in client.of("response.output_audio.delta") if e["response_id"] == answer_id),
        strict=True))
    assert not any(l["kind"] == "client" and l["event"]["type"] == "input_audio_buffer.append" for l in lines)
    assert not any(d[:64] in text for d in deltas)
    spoken = pcm16_b64(question[len(question) // 2:len(question) // 2 + PCM_RATE // 50])
    assert spoken[:64] not in text

    # Left: the caller's speech, one stretch (its pauses joined), where the VAD events say it was.
    caller = runs(wav[:, 0], gap_s=0.6)
    assert len(caller) == 1, caller
    onset, end = caller[0]
    assert onset <= started[0]["t"] <= onset + VAD_DELAY_S, (caller, started[0]["t"])
    assert end + SILENCE_S - 0.2 <= stopped_line[0]["t"] <= end + SILENCE_S + VAD_DELAY_S, (
        caller, stopped_line[0]["t"])
    spoken_s = audible_s(question)
    assert abs((end - onset) - spoken_s) <= 0.1, (end - onset, spoken_s)

    # Right: the agent's answer, from when it was sent, as long as it is, nothing before.
    agent = runs(wav[:, 1])
    assert len(agent) == 1, agent
    begin, finish = agent[0]
    assert created_t <= begin + 0.02 and abs(begin - delta_lines[0]["t"]) <= 0.06, (agent, created_t)
    assert abs((finish - begin) - answer_s) <= 0.1, (agent, answer_s)
    assert stopped_line[0]["t"] <= begin + 0.02  # (the runs are of 20 ms frames)
    heard = wav[int(begin * RATE):int(finish * RATE), 1]
    level = float(np.sqrt(np.mean(heard**2))) / float(np.sqrt(np.mean(received**2)))
    assert 0.8 <= level <= 1.25, level


def audible_s(samples: np.ndarray) -> float:
    """How long the audible stretch of a 24 kHz clip lasts (its pauses joined), measured as
    ``runs`` measures the recording's."""
    resampled = np.interp(np.arange(0, len(samples), PCM_RATE / RATE), np.arange(len(samples)), samples)
    found = runs(resampled.astype(np.float32), gap_s=0.6)
    assert len(found) == 1, found
    return found[0][1] - found[0][0]
