"""What the tests of the OpenAI-compatible APIs share: preset, metrics, audio, a realtime client.

The server (conftest.py) runs the toy model with long answers (60 words, the talker at 25 ms a
frame: about 4.5 s to generate 14.4 s of audio) so that a response is still running when a test
cancels or interrupts it; tests that want a whole answer quickly cap it with ``max_output_tokens``
/ ``max_completion_tokens``.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import yaml
from openai import AsyncOpenAI
from websockets.exceptions import ConnectionClosed

from harness.peers import Changes
from harness.server import ROOT, ServerProcess

API_KEY = "sk-duplex-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_SESSIONS = 3
SHORT_ANSWER = 3  # words: a whole answer in ~0.2 s
TIMEOUT = 20.0
PCM_RATE = 24000


def toy_pipeline(**stage_changes: dict[str, Any]) -> dict[str, Any]:
    """configs/toy.yaml's pipeline; ``talker={"options": {...}, ...}`` updates that stage."""
    pipeline = yaml.safe_load((ROOT / "configs" / "toy.yaml").read_text())["pipeline"]
    for stage in pipeline["stages"]:
        changes = dict(stage_changes.get(stage["name"], {}))
        stage["options"] = {**stage.get("options", {}), **changes.pop("options", {})}
        stage.update(changes)
    return pipeline


def _stage(pipeline: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in pipeline["stages"] if s["name"] == name)


PIPELINE = toy_pipeline(thinker={"options": {"answer_tokens": 60}},
                        talker={"options": {"step_delay_s": 0.025}})
ANSWER_WORDS = _stage(PIPELINE, "thinker")["options"]["answer_tokens"]
FRAMES_PER_WORD = _stage(PIPELINE, "talker")["options"]["frames_per_token"]
FRAME_SAMPLES = 1920  # the toy vocoder's 80 ms frame at 24 kHz
STAGES = [s["name"] for s in PIPELINE["stages"]]


FULL_ANSWER_SAMPLES = ANSWER_WORDS * FRAMES_PER_WORD * FRAME_SAMPLES


def answer_samples(transcript: str) -> int:
    """The toy's audio for a transcript: FRAMES_PER_WORD frames per word, at 24 kHz."""
    return len(transcript.split()) * FRAMES_PER_WORD * FRAME_SAMPLES


# --- the server's state, read through /metrics -------------------------------------------------

def metric(server: ServerProcess, name: str, labels: dict[str, str] | None = None) -> float:
    return server.metric(name, labels, headers=AUTH)


async def eventually(condition: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> None:
    """Poll a condition on the server (another process: nothing to wait on but its metrics)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)  # stage gauges arrive with the stages' periodic stats


def pipeline_idle(server: ServerProcess) -> bool:
    return metric(server, "pipeline_requests_active") == 0 and not any(
        metric(server, "pipeline_stage_live_requests", {"stage": s}) for s in STAGES)


def aborts(server: ServerProcess) -> float:
    """Pipeline requests aborted so far (a completed request is never aborted)."""
    return metric(server, "pipeline_abort_clear_seconds_count")


# --- audio --------------------------------------------------------------------------------------

def pcm16_b64(samples: np.ndarray) -> str:
    pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode("ascii")


def decode_pcm16(chunks: list[str]) -> np.ndarray:
    raw = b"".join(base64.b64decode(c) for c in chunks)
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


def rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(samples**2))) if len(samples) else 0.0


# --- a realtime client on the openai SDK ----------------------------------------------------------

def user_text(text: str) -> dict[str, Any]:
    """A user message item for ``conversation.item.create``."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


class RealtimeClient(Changes):
    """An SDK realtime connection and every event it received (read by a background task)."""

    def __init__(self, connection: Any) -> None:
        super().__init__()
        self.connection = connection
        self.events: list[Any] = []
        self.closed: ConnectionClosed | None = None
        self.ended = False
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            async for event in self.connection:
                self.events.append(event)
                self.notify()
        except ConnectionClosed as err:
            self.closed = err
        finally:
            self.ended = True
            self.notify()

    def types(self) -> list[str]:
        return [e.type for e in self.events]

    def of(self, kind: str) -> list[Any]:
        return [e for e in self.events if e.type == kind]

    async def wait(self, kind: str, count: int = 1) -> Any:
        """The ``count``-th event of ``kind``; fails at once if the connection ended without it."""
        def found() -> Any:
            hits = self.of(kind)
            if len(hits) >= count:
                return hits[count - 1]
            assert not self.ended, f"ended ({self.closed}) before {kind} #{count}: {self.types()}"
            return None

        try:
            return await self.wait_for(found)
        except TimeoutError:
            raise AssertionError(f"no {kind} #{count} in {TIMEOUT:.0f} s: {self.types()}") from None

    async def append(self, samples: np.ndarray, chunk_ms: int = 100) -> None:
        """24 kHz float audio as ``input_audio_buffer.append`` events of ``chunk_ms`` each."""
        step = PCM_RATE * chunk_ms // 1000
        for start in range(0, len(samples), step):
            piece = pcm16_b64(samples[start:start + step])
            await self.connection.input_audio_buffer.append(audio=piece)

    def audio(self, response_id: str) -> np.ndarray:
        return decode_pcm16([e.delta for e in self.of("response.output_audio.delta")
                             if e.response_id == response_id])


@asynccontextmanager
async def realtime(server: ServerProcess, model: str = "gpt-realtime",
                   api_key: str = API_KEY) -> AsyncIterator[RealtimeClient]:
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=api_key)
    async with client.realtime.connect(model=model) as connection:
        rt = RealtimeClient(connection)
        try:
            yield rt
        finally:
            rt.reader.cancel()
