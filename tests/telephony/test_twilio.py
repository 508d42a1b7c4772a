"""Twilio Media Streams: a client written here from Twilio's public protocol plays the part of
Twilio against a real ``duplex.serve`` (toy model, paced like a real one): it streams a caller's
μ-law audio in real time, plays what it receives on a real-time clock and echoes each mark when its
playback reaches it, drops its buffer on ``clear``, and ends with ``stop``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
import websockets

from duplex.media.pcm import float_to_pcm16, ulaw_decode, ulaw_encode
from harness.calls import INTERRUPTION, QUESTION, wait_stages_idle
from harness.server import ServerProcess, run_server, write_preset
from harness.speech import speech

pytestmark = pytest.mark.e2e

RATE = 8000
FRAME = 160  # 20 ms
TIMEOUT = 30.0
VOICED = 500


CONNECTED = json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"})


def start_message(sid: str, **custom_parameters: str) -> str:
    """Twilio's ``start`` for stream ``sid``, with the TwiML's ``<Parameter>``s."""
    return json.dumps({"event": "start", "sequenceNumber": "1", "streamSid": sid,
                       "start": {"streamSid": sid, "callSid": "CA0000", "tracks": ["inbound"],
                                 "customParameters": custom_parameters,
                                 "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": RATE,
                                                 "channels": 1}}})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("twilio")
    preset = write_preset(tmp / "preset.yaml", stages={
        "thinker": {"options": {"step_delay_s": 0.2}}, "talker": {"options": {"step_delay_s": 0.05}}})
    with run_server(preset, tmp=tmp) as running:
        yield running


@dataclass
class FakeTwilio:
    """Twilio's side of one media stream (see module doc)."""

    ws: websockets.ClientConnection
    sid: str = "MZ0000"
    received: list[dict] = field(default_factory=list)  # every message from the server
    played: list[tuple[float, np.ndarray]] = field(default_factory=list)  # (when, 20 ms of audio)
    _queue: list[tuple[float, str | np.ndarray]] = field(default_factory=list)  # marks and audio
    _play_end: float = 0.0
    speaking: asyncio.Queue[np.ndarray] = field(default_factory=asyncio.Queue)

    async def start(self) -> None:
        await self.ws.send(CONNECTED)
        await self.ws.send(start_message(self.sid))

    async def receive(self) -> None:
        async for raw in self.ws:
            message = json.loads(raw)
            self.received.append(message)
            now = asyncio.get_running_loop().time()
            if message["event"] == "media":
                audio = ulaw_decode(base64.b64decode(message["media"]["payload"]))
                start = max(now, self._play_end)
                for i in range(0, len(audio), FRAME):
                    self._queue.append((start + i / RATE, audio[i : i + FRAME]))
                self._play_end = start + len(audio) / RATE
            elif message["event"] == "mark":
                self._queue.append((max(now, self._play_end), message["mark"]["name"]))
            elif message["event"] == "clear":
                self._queue.clear()
                self._play_end = now

    async def play(self) -> None:
        """The playback clock: audio is heard and marks are echoed when their time comes."""
        while True:
            now = asyncio.get_running_loop().time()
            while self._queue and self._queue[0][0] <= now:
                when, item = self._queue.pop(0)
                if isinstance(item, str):
                    await self.ws.send(json.dumps({"event": "mark", "streamSid": self.sid,
                                                   "mark": {"name": item}}))
                else:
                    self.played.append((when, item))
            await asyncio.sleep(0.01)  # the player's 10 ms tick

    async def talk(self) -> None:
        """The caller's microphone: what ``say`` queued, else silence, 20 ms every 20 ms."""
        loop = asyncio.get_running_loop()
        pending = np.zeros(0, np.int16)
        next_at = loop.time()
        while True:
            while not self.speaking.empty():
                pending = np.concatenate([pending, self.speaking.get_nowait()])
            frame, pending = pending[:FRAME], pending[FRAME:]
            frame = np.pad(frame, (0, FRAME - len(frame)))
            await self.ws.send(json.dumps({"event": "media", "streamSid": self.sid, "media": {
                "track": "inbound", "payload": base64.b64encode(ulaw_encode(frame)).decode()}}))
            next_at += FRAME / RATE
            await asyncio.sleep(max(0.0, next_at - loop.time()))  # real-time pacing of the caller

    def say(self, text: str) -> float:
        """Queue ``text`` as the caller's speech; returns its duration in seconds."""
        audio = float_to_pcm16(speech(text, RATE, 0.2, 0.0))
        self.speaking.put_nowait(audio)
        return len(audio) / RATE

    def heard_seconds(self, since: float = 0.0) -> float:
        return sum(len(a) for t, a in self.played
                   if t >= since and np.sqrt(np.mean(a.astype(float) ** 2)) > VOICED) / RATE

    def count(self, event: str) -> int:
        return sum(1 for m in self.received if m["event"] == event)

    async def until(self, condition, timeout: float = TIMEOUT) -> None:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def twilio_call(server: ServerProcess) -> AsyncIterator[FakeTwilio]:
    url = server.url.replace("http://", "ws://") + "/v1/telephony/twilio"
    async with websockets.connect(url) as ws:
        call = FakeTwilio(ws)
        await call.start()
        tasks = [asyncio.create_task(c()) for c in (call.receive, call.play, call.talk)]
        try:
            yield call
        finally:
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.send(json.dumps({"event": "stop", "streamSid": call.sid}))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def wait_sessions_gone(server: ServerProcess) -> None:
    deadline = asyncio.get_running_loop().time() + 15
    while server.metric("duplex_sessions_active", {"transport": "twilio"}) > 0:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.1)  # the gauge lives in another process: polled


async def test_answered_interrupted_with_clear_and_ended_by_stop(server: ServerProcess) -> None:
    barge_ins = server.metric("duplex_barge_ins_total")
    async with twilio_call(server) as call:
        call.say(QUESTION)
        await call.until(lambda: call.heard_seconds() >= 1.2)
        assert call.count("mark") >= 2 and call.count("clear") == 0
        loop = asyncio.get_running_loop()
        spoke_at = loop.time()
        duration = call.say(INTERRUPTION)
        await call.until(lambda: call.count("clear") >= 1)
        # The caller stopped hearing the agent at once, and heard nothing more while talking.
        cleared_at = loop.time()
        assert cleared_at - spoke_at < 1.0
        await call.until(lambda: loop.time() > spoke_at + duration)
        assert call.heard_seconds(since=cleared_at + 0.1) == 0.0
        # The interruption was answered afterwards.
        await call.until(lambda: call.heard_seconds(since=spoke_at + duration) > 0.5)
    assert server.metric("duplex_barge_ins_total") == barge_ins + 1
    await wait_sessions_gone(server)
    await wait_stages_idle(server)


async def test_a_false_interruption_plays_the_answer_again_from_the_last_mark(
        server: ServerProcess) -> None:
    barge_ins = server.metric("duplex_barge_ins_total")
    async with twilio_call(server) as call:
        call.say(QUESTION)
        await call.until(lambda: call.heard_seconds() >= 1.2)
        word = float_to_pcm16(speech("Hey", RATE, 0.0, 0.0))
        onset = int(np.nonzero(np.abs(word) > 300)[0][0])
        call.speaking.put_nowait(word[onset : onset + RATE // 10])  # 100 ms: a click, not a turn
        await call.until(lambda: call.count("clear") >= 1)
        # Sent again from the last acknowledged mark, the whole answer is heard, nothing twice.
        await call.until(lambda: call.heard_seconds() >= 2.8)
        assert call.heard_seconds() < 2.88 + 0.5
    assert server.metric("duplex_barge_ins_total") == barge_ins
    await wait_sessions_gone(server)


async def test_media_before_start_closes_the_stream(server: ServerProcess) -> None:
    url = server.url.replace("http://", "ws://") + "/v1/telephony/twilio"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"event": "media", "media": {"payload": ""}}))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), TIMEOUT)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    await wait_sessions_gone(server)


async def test_the_voice_webhook_connects_the_call_to_the_stream(server: ServerProcess) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{server.url}/v1/telephony/twilio/voice")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/xml")
    host = server.url.removeprefix("http://")
    assert f'<Stream url="ws://{host}/v1/telephony/twilio">' in response.text
    assert response.text.startswith('<?xml version="1.0"') and "<Connect>" in response.text


async def test_media_faster_than_real_time_has_its_excess_dropped_before_decoding(
        server: ServerProcess) -> None:
    """20 s of media sent at once: the stream's real-time budget (1.5x, bursts of 2 s) lets a few
    seconds through and counts the rest as dropped; the call goes on."""
    dropped = "duplex_inbound_audio_dropped_seconds_total"
    before = server.metric(dropped, {"transport": "twilio"})
    url = server.url.replace("http://", "ws://") + "/v1/telephony/twilio"
    frame = base64.b64encode(ulaw_encode(np.zeros(FRAME, dtype=np.float32))).decode()
    media = json.dumps({"event": "media", "streamSid": "MZflood", "media": {"payload": frame}})
    async with websockets.connect(url) as ws:
        await ws.send(CONNECTED)
        await ws.send(start_message("MZflood"))
        for _ in range(1000):  # 20 s of 20 ms frames, as fast as the socket takes them
            await ws.send(media)
        deadline = asyncio.get_running_loop().time() + TIMEOUT
        # The server counts as it reads: the counter lives in another process, so it is polled.
        while server.metric(dropped, {"transport": "twilio"}) - before < 10:
            assert asyncio.get_running_loop().time() < deadline, "the excess was not dropped"
            await asyncio.sleep(0.1)
        dropped_s = server.metric(dropped, {"transport": "twilio"}) - before
        assert dropped_s <= 20 - 2 + 1e-6  # the burst and what refilled meanwhile went through
        await ws.send(json.dumps({"event": "stop", "streamSid": "MZflood"}))
    await wait_sessions_gone(server)
