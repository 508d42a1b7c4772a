"""The agent hangs up a Realtime WebSocket, end to end: a real ``python -m duplex.serve`` (the toy
preset, its pipeline in the server's process: it starts in seconds) and a plain ``websockets``
client that sends its microphone as ``input_audio_buffer.append``.

The idle timer runs on the caller's audio (duplex/session/idle.py), so these tests send silence as
fast as the server takes it and count what they sent: a read-only barrier event after each chunk
(:meth:`WsClient.barrier`: client events are handled in order, each to its end) tells which chunk
made the server act. Nothing here waits on the clock except the longest call, which is on the clock.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import websockets

from harness.peers import Changes
from harness.server import ServerProcess, run_server, write_preset
from harness.speech import speech
from tests.api.helpers import eventually
from tests.operators.conftest import toy_pipeline

PCM_RATE = 24000  # audio/pcm, the session's default input format
CHUNK_MS = 100
IDLE_MS = 5000  # OpenAI's shortest idle_timeout_ms
WINDOW_MS = 32  # the VAD's window: where the caller's audio position moves
ANSWER_WORDS = 4  # the toy's answers: 4 words x 3 frames x 80 ms = 0.96 s of audio
MAX_CALL_S = 2.0
TIMEOUT = 20.0
QUESTION = "Yes, I am still here. What is the weather like tomorrow?"

_barriers = itertools.count()


@pytest.fixture(scope="module")
def idle_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One check-in: the first idle timeout asks, the second ends the call."""
    tmp = tmp_path_factory.mktemp("idle")
    preset = write_preset(tmp / "preset.yaml", pipeline=toy_pipeline(ANSWER_WORDS), pipeline_mode="inproc",
                          session={"check_ins": 1,
                                   "turn_detection": {"type": "server_vad", "idle_timeout_ms": IDLE_MS}})
    with run_server(preset, tmp=tmp) as running:
        yield running


@pytest.fixture(scope="module")
def short_call_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("short_call")
    preset = write_preset(tmp / "preset.yaml", pipeline=toy_pipeline(ANSWER_WORDS), pipeline_mode="inproc",
                          session={"max_call_s": MAX_CALL_S})
    with run_server(preset, tmp=tmp) as running:
        yield running


# --- a Realtime client on a bare WebSocket (the close code is what these tests are about) ------

def pcm16_b64(samples: np.ndarray) -> str:
    pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode("ascii")


class WsClient(Changes):
    """A Realtime WebSocket connection and every event it received, read by a background task;
    ``close_code`` once the server (or the client) closed it."""

    def __init__(self, ws: Any) -> None:
        super().__init__()
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self.received_at: list[float] = []  # time.monotonic() when each event came
        self.ended_at: float | None = None  # time.monotonic() when the connection ended
        self.sent_ms = 0  # audio appended so far
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                self.events.append(json.loads(raw))
                self.received_at.append(time.monotonic())
                self.notify()
        except websockets.ConnectionClosed:
            pass
        finally:
            self.ended_at = time.monotonic()
            self.notify()

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    @property
    def close_code(self) -> int | None:
        return self.ws.close_code

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def index(self, event: dict[str, Any]) -> int:
        return next(i for i, e in enumerate(self.events) if e is event)

    async def wait(self, condition: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
        """``condition()`` once true; fails when the connection ends first or after ``timeout``."""
        def check() -> Any:
            result = condition()
            if not result and self.ended:
                raise AssertionError(f"the connection ended (code {self.close_code}) before {what}: "
                                     f"{self.types()[-12:]}")
            return result

        try:
            return await self.wait_for(check, timeout)
        except TimeoutError:
            raise AssertionError(f"no {what} within {timeout:.0f} s: {self.types()[-12:]}") from None

    async def wait_event(self, kind: str, after: int = 0, **fields: Any) -> dict[str, Any]:
        """The first event of ``kind`` at index ``after`` or later whose fields match."""
        def found() -> dict[str, Any] | None:
            return next((e for e in self.events[after:] if e["type"] == kind
                         and all(e.get(k) == v for k, v in fields.items())), None)

        return await self.wait(found, f"{kind} {fields or ''}")

    async def wait_done(self, response_id: str) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((e for e in self.of("response.done") if e["response"]["id"] == response_id), None)

        return await self.wait(found, f"response.done of {response_id}")

    async def wait_closed(self, timeout: float = TIMEOUT) -> None:
        try:
            await self.wait_for(lambda: self.ended, timeout)
        except TimeoutError:
            raise AssertionError(f"the server did not close within {timeout:.0f} s: "
                                 f"{self.types()[-12:]}") from None

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(message))

    async def append(self, samples: np.ndarray) -> None:
        """24 kHz float audio as ``input_audio_buffer.append`` events of CHUNK_MS each."""
        step = PCM_RATE * CHUNK_MS // 1000
        for start in range(0, len(samples), step):
            piece = samples[start:start + step]
            await self.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(piece)})
            self.sent_ms += len(piece) * 1000 // PCM_RATE

    async def silence(self, ms: int) -> None:
        await self.append(np.zeros(PCM_RATE * ms // 1000, dtype=np.float32))

    async def barrier(self) -> int:
        """Wait until the server handled everything sent so far; returns how many events had come
        then. A retrieve of an item that does not exist: an error that changes nothing, answered in
        the order of the client's events."""
        event_id = f"event_barrier_{next(_barriers)}"
        await self.send({"type": "conversation.item.retrieve", "event_id": event_id,
                         "item_id": "item_that_does_not_exist"})
        reply = await self.wait(lambda: next((e for e in self.of("error")
                                              if e["error"].get("event_id") == event_id), None),
                                f"the reply to {event_id}")
        return self.index(reply)

    async def silence_until(self, condition: Callable[[], Any], limit_ms: int) -> int:
        """Silence, a chunk at a time, until ``condition()`` holds after a chunk was handled;
        returns the ms sent (the chunk that made it true included)."""
        sent = 0
        while sent < limit_ms:
            await self.silence(CHUNK_MS)
            sent += CHUNK_MS
            await self.barrier()
            if condition():
                return sent
        raise AssertionError(f"not within {limit_ms} ms of silence: {self.types()[-12:]}")

    def non_barrier_types(self, after: int = 0) -> list[str]:
        return [e["type"] for e in self.events[after:]
                if not (e["type"] == "error" and str(e["error"].get("event_id")).startswith("event_barrier_"))]


@asynccontextmanager
async def connect(server: ServerProcess) -> AsyncIterator[WsClient]:
    url = server.url.replace("http://", "ws://") + "/v1/realtime?model=gpt-realtime"
    async with websockets.connect(url, max_size=None) as ws:
        client = WsClient(ws)
        try:
            await client.wait_event("session.created")
            yield client
        finally:
            client.reader.cancel()


def websocket_sessions(server: ServerProcess) -> float:
    """Live WebSocket sessions; a missing gauge fails (ServerProcess.metric), never reads as 0."""
    return server.metric("duplex_sessions_active", {"transport": "websocket"})


def audio_ms(client: WsClient, response_id: str) -> int:
    """The agent audio sent for a response, in ms (24 kHz pcm16)."""
    size = sum(len(base64.b64decode(e["delta"])) for e in client.of("response.output_audio.delta")
               if e["response_id"] == response_id)
    return size // 2 * 1000 // PCM_RATE


async def check_in_after_timeout(client: WsClient, timeout: dict[str, Any]) -> dict[str, Any]:
    """A timeout that asks (not one that ends the call): its silence committed as its item, then
    a response, which completes; returns that response.done."""
    at = client.index(timeout)
    committed = await client.wait_event("input_audio_buffer.committed", at, item_id=timeout["item_id"])
    created = await client.wait_event("response.created", client.index(committed))
    done = await client.wait_done(created["response"]["id"])
    assert done["response"]["status"] == "completed", done
    return done


# --- the tests ------------------------------------------------------------------------------------

async def test_unanswered_check_in_ends_the_call_with_a_goodbye_then_close_1000(idle_server: ServerProcess) -> None:
    async with connect(idle_server) as client:
        created = client.of("session.created")[0]["session"]
        assert created["audio"]["input"]["turn_detection"]["idle_timeout_ms"] == IDLE_MS
        assert websocket_sessions(idle_server) == 1
        # 4.9 s of silence, all handled by the server: no timeout yet.
        await client.silence(IDLE_MS - CHUNK_MS)
        await client.barrier()
        assert client.of("input_audio_buffer.timeout_triggered") == [], client.types()
        # The chunk that crosses 5 s (the VAD moves in 32 ms windows: 5024 ms) fires it.
        await client.silence_until(lambda: client.of("input_audio_buffer.timeout_triggered"), 1000)
        first = client.of("input_audio_buffer.timeout_triggered")[0]
        assert IDLE_MS < client.sent_ms <= IDLE_MS + CHUNK_MS, client.sent_ms
        assert first["audio_start_ms"] == 0
        assert IDLE_MS <= first["audio_end_ms"] - first["audio_start_ms"] < IDLE_MS + WINDOW_MS, first
        assert first["audio_end_ms"] <= client.sent_ms
        check_in = await check_in_after_timeout(client, first)
        check_in_id = check_in["response"]["id"]
        check_in_ms = audio_ms(client, check_in_id)
        assert check_in_ms > 0
        assert not client.ended

        # Nobody answers: the next timeout counts from the end of the check-in's audio, which the
        # client plays at real time from its first chunk on (what it still had to play at
        # response.done counts), not from response.done.
        first_chunk = next(e for e in client.of("response.output_audio.delta") if e["response_id"] == check_in_id)
        played_ms = 1000 * (client.received_at[client.index(check_in)] - client.received_at[client.index(first_chunk)])
        left_ms = check_in_ms - played_ms
        assert left_ms > 3 * CHUNK_MS, (check_in_ms, played_ms)  # the toy generates faster than real time
        before = client.sent_ms
        after_done = len(client.events)
        silent = await client.silence_until(
            lambda: len(client.of("input_audio_buffer.timeout_triggered")) == 2, IDLE_MS + check_in_ms + 1000)
        assert IDLE_MS + left_ms - 2 * CHUNK_MS <= silent <= IDLE_MS + check_in_ms + CHUNK_MS, (silent, left_ms)
        assert client.sent_ms == before + silent
        second = client.of("input_audio_buffer.timeout_triggered")[1]
        assert IDLE_MS <= second["audio_end_ms"] - second["audio_start_ms"] < IDLE_MS + check_in_ms + WINDOW_MS
        assert client.index(second) >= after_done
        # The goodbye: a response (no silence committed: nothing is asked), then the close.
        at = client.index(second)
        goodbye = await client.wait_event("response.created", at)
        goodbye_id = goodbye["response"]["id"]
        done = await client.wait_done(goodbye_id)
        assert done["response"]["status"] == "completed", done
        assert audio_ms(client, goodbye_id) > 0  # the goodbye was spoken
        await client.wait_closed()
        assert client.close_code == 1000, (client.close_code, client.ws.close_reason)
        # Closed after the goodbye's events: response.done of the goodbye is the last thing sent.
        assert client.non_barrier_types(client.index(done) + 1) == [], client.types()[-6:]
        assert not [e for e in client.of("input_audio_buffer.committed") if e["item_id"] == second["item_id"]]
        assert len(client.of("response.created")) == 2  # the check-in and the goodbye, no more
    await eventually(lambda: websocket_sessions(idle_server) == 0, "the session's slot to be released")


async def test_a_caller_who_answers_the_check_in_keeps_the_call(idle_server: ServerProcess) -> None:
    async with connect(idle_server) as client:
        await client.silence_until(lambda: client.of("input_audio_buffer.timeout_triggered"), IDLE_MS + 500)
        first = client.of("input_audio_buffer.timeout_triggered")[0]
        await check_in_after_timeout(client, first)
        # The caller answers: a turn of speech, which the agent answers.
        at = len(client.events)
        await client.append(speech(QUESTION, PCM_RATE, 0.3, 1.0))
        await client.wait_event("input_audio_buffer.speech_started", at)
        stopped = await client.wait_event("input_audio_buffer.speech_stopped", at)
        answer = await client.wait_event("response.created", client.index(stopped))
        answer_id = answer["response"]["id"]
        await client.wait_done(answer_id)
        answer_ms = audio_ms(client, answer_id)
        # The period after which an unanswered check-in would have ended the call: it asks again.
        silent = await client.silence_until(
            lambda: len(client.of("input_audio_buffer.timeout_triggered")) == 2, IDLE_MS + answer_ms + 1000)
        assert IDLE_MS < silent <= IDLE_MS + answer_ms + CHUNK_MS, (silent, answer_ms)
        second = client.of("input_audio_buffer.timeout_triggered")[1]
        await check_in_after_timeout(client, second)
        # Still open after that check-in's response.done (a goodbye would close right there).
        await client.barrier()
        assert not client.ended, (client.close_code, client.types()[-6:])
        assert websocket_sessions(idle_server) == 1
        await client.ws.close()
    await eventually(lambda: websocket_sessions(idle_server) == 0, "the session's slot to be released")


async def test_the_longest_call_ends_with_a_closing_line_then_close_1000(short_call_server: ServerProcess) -> None:
    """No audio at all: the call's length runs on the clock too (Idle.start, from the binding)."""
    began = time.monotonic()
    async with connect(short_call_server) as client:
        assert websocket_sessions(short_call_server) == 1
        closing = await client.wait_event("response.created")
        closing_id = closing["response"]["id"]
        done = await client.wait_done(closing_id)
        assert done["response"]["status"] == "completed", done
        assert audio_ms(client, closing_id) > 0
        await client.wait_closed()
        assert client.close_code == 1000, (client.close_code, client.ws.close_reason)
        assert client.ended_at - began >= MAX_CALL_S
        assert client.non_barrier_types(client.index(done) + 1) == [], client.types()[-6:]
        assert client.of("input_audio_buffer.timeout_triggered") == []
    await eventually(lambda: websocket_sessions(short_call_server) == 0, "the session's slot to be released")
