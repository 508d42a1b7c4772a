"""The user's words told while they speak, on the default CPU preset (``offline``: Whisper tiny.en
recognises the turn so far every second) over the Realtime WebSocket: a client that asked for
transcripts gets firmed words before the turn ends, a final transcript as good as before, and the
pipeline holds nothing once the session closed."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import websockets

from duplex.media.pcm import float_to_pcm16
from harness.calls import wait_stages_idle
from harness.server import ServerProcess, run_server, write_preset
from harness.speech import natural_speech
from harness.wer import wer

pytestmark = pytest.mark.e2e

SAID = "Please tell me a short story about a brave little dog who lives on a farm."
RATE = 24000  # audio/pcm on the Realtime WebSocket
CHUNK = RATE // 50  # 20 ms, as a microphone sends it
TIMEOUT = 60.0
DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("live")
    with run_server(write_preset(tmp / "preset.yaml", base="offline"), tmp=tmp) as running:
        yield running


async def speak(ws: websockets.ClientConnection, audio: np.ndarray, until: asyncio.Event) -> None:
    """Append ``audio`` as a microphone would, 20 ms every 20 ms, then silence the same way until
    ``until`` is set (the turn is committed): the turn detector runs on the audio's own time."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    silence = np.zeros(CHUNK, np.float32)
    for index in itertools.count():
        if index * CHUNK >= len(audio) and until.is_set():
            return
        chunk = audio[index * CHUNK : (index + 1) * CHUNK] if index * CHUNK < len(audio) else silence
        data = base64.b64encode(float_to_pcm16(chunk).tobytes()).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": data}))
        await asyncio.sleep(max(0.0, start + (index + 1) * 0.02 - loop.time()))  # the mic's pace


async def test_words_arrive_while_the_user_speaks_and_nothing_is_left_in_flight(
        server: ServerProcess) -> None:
    url = server.url.replace("http://", "ws://") + "/v1/realtime?model=offline"
    events: list[dict[str, Any]] = []
    committed = asyncio.Event()
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}}))
        mic = asyncio.create_task(speak(ws, natural_speech(SAID, RATE, 0.3, 0.0), committed))
        async with asyncio.timeout(TIMEOUT):
            while not events or events[-1]["type"] != "response.done":
                events.append(json.loads(await ws.recv()))
                if events[-1]["type"] == "input_audio_buffer.committed":
                    committed.set()
        await mic
    types = [e["type"] for e in events]
    assert "error" not in types, [e for e in events if e["type"] == "error"]
    stopped = types.index("input_audio_buffer.speech_stopped")
    item_id = events[stopped]["item_id"]
    deltas = [(i, e["delta"]) for i, e in enumerate(events) if e["type"] == DELTA]
    assert any(i < stopped for i, _ in deltas), types
    assert {e["item_id"] for e in events if e["type"] in (DELTA, COMPLETED)} == {item_id}
    (completed,) = [e for e in events if e["type"] == COMPLETED]
    assert wer(SAID, completed["transcript"]) <= 0.2, completed["transcript"]
    assert "".join(delta for _, delta in deltas) == completed["transcript"], deltas
    await wait_stages_idle(server, ["asr", "judge", "lm", "tts"])
