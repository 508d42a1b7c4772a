"""A caller on a speakerphone, over the Realtime WebSocket: the app (duplex.serve's) on a real
uvicorn server in this process, a pipeline fake that answers in espeak speech (the toy's tones are
no speech to the VAD, so its echo would never interrupt anything), and a ``websockets`` client
that plays the agent's audio as it comes, in real time, and whose microphone hears it again
``DELAY_S`` later through a synthetic room, plus the caller's own words.

With echo cancellation (the default) the agent answers to its end; without it (the session's
``audio.input.echo_cancellation: false``) the agent hears itself and interrupts itself. Double
talk: the caller's words over the echo interrupt as the VAD allows, with and without ``near_field``
noise suppression.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import websockets
from fastapi import FastAPI

from harness.peers import Changes
from harness.server import serving
from harness.speech import natural_speech, speech
from harness.wer import wer
from pipeline.models.offline.asr import Transcriber
from tests.e2e.speakerphone import (
    ANSWER_RATE,
    INTERRUPTION,
    QUESTION,
    EchoPath,
    answer_audio,
    speaking_app,
)

RATE = ANSWER_RATE  # audio/pcm, both ways
TICK = RATE // 50  # the microphone sends 20 ms at a time, in real time
DELAY_S = 0.2  # loudspeaker to microphone, and back through the network
TIMEOUT = 30.0
ANSWER_SAMPLES = len(answer_audio())
CORRECTION = "Wait, I meant the weekend. Is it going to rain on Saturday or Sunday?"


class Speakerphone(Changes):
    """A Realtime client whose loudspeaker is heard by its microphone (see module doc). It stops
    playing at ``input_audio_buffer.speech_started``, as a Realtime client must."""

    def __init__(self, ws: Any, user: np.ndarray) -> None:
        super().__init__()
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self.user = user  # what the caller says, from the microphone's first sample on
        self._queue = np.zeros(0, dtype=np.float32)  # agent audio received, not played yet
        self.echo = EchoPath(RATE, DELAY_S)
        self.sent = 0  # microphone samples sent
        self.played = 0  # agent samples the loudspeaker played
        self.talk_at: int | None = None  # where (microphone samples) the caller's words go in

    async def read(self) -> None:
        async for raw in self.ws:
            event = json.loads(raw)
            self.events.append(event)
            if event["type"] == "response.output_audio.delta":
                pcm = np.frombuffer(base64.b64decode(event["delta"]), dtype="<i2")
                self._queue = np.concatenate([self._queue, pcm.astype(np.float32) / 32768.0])
            elif event["type"] == "input_audio_buffer.speech_started":
                self._queue = self._queue[:0]
            self.notify()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def _tick(self) -> np.ndarray:
        """20 ms: the loudspeaker plays, the room and the delay carry it, the microphone hears."""
        played = np.zeros(TICK, dtype=np.float32)
        take = min(TICK, len(self._queue))
        played[:take], self._queue = self._queue[:take], self._queue[take:]
        self.played += take
        mic = self.echo.hear(played)
        if self.talk_at is not None:
            words = self.user[self.sent - self.talk_at : self.sent - self.talk_at + TICK]
            mic[: len(words)] += words
        return mic

    async def microphone(self) -> None:
        """Sends the microphone in real time (a microphone's pace, not a synchronisation)."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            pcm = np.clip(np.round(self._tick() * 32768.0), -32768, 32767).astype("<i2")
            await self.ws.send(json.dumps({"type": "input_audio_buffer.append",
                                           "audio": base64.b64encode(pcm.tobytes()).decode()}))
            self.sent += TICK
            self.notify()
            due += TICK / RATE
            await asyncio.sleep(max(0.0, due - loop.time()))

    async def until(self, condition: Any, what: str) -> Any:
        try:
            return await self.wait_for(condition, TIMEOUT)
        except TimeoutError:
            raise AssertionError(f"no {what}: {[e['type'] for e in self.events][-15:]}") from None


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    return speaking_app(tmp_path_factory.mktemp("echo"))


@pytest.fixture(scope="module")
async def port(app: FastAPI) -> AsyncIterator[int]:
    async with serving(app) as number:
        yield number


async def call(port: int, session: dict[str, Any], interrupt_after_s: float | None = None,
               interruption: np.ndarray | None = None, whole_turns: bool = False) -> Speakerphone:
    """One call: the question, then the answer heard on the speakerphone (and, with
    ``interrupt_after_s``, the caller's ``interruption`` that far into it: :data:`INTERRUPTION`
    in a second espeak voice unless given), until the answer is done and its echo has come back;
    with ``whole_turns``, also until the interruption was said in full and every turn it began
    was committed."""
    question = speech(QUESTION, RATE, 0.2, 0.0)
    if interruption is None:
        interruption = speech(INTERRUPTION, RATE, 0.0, 0.5, voice="en-us+f3")
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime?model=gpt-realtime") as ws:
        phone = Speakerphone(ws, question)
        reader = asyncio.create_task(phone.read())
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        await phone.until(lambda: phone.of("session.updated"), "session.updated")
        phone.talk_at = 0
        mic = asyncio.create_task(phone.microphone())
        try:
            await phone.until(lambda: phone.of("response.created"), "an answer")
            if interrupt_after_s is not None:
                await phone.until(lambda: phone.played >= interrupt_after_s * RATE, "playback")
                phone.user, phone.talk_at = interruption, phone.sent
            await phone.until(lambda: phone.of("response.done"), "response.done")
            # The rest of the answer plays out (unless stopped) and its echo comes back.
            await phone.until(lambda: not len(phone._queue) and phone.echo.quiet, "the echo")
            quiet_until = phone.sent + int(0.8 * RATE)
            await phone.until(lambda: phone.sent >= quiet_until, "the echo's tail")
            if whole_turns:
                await phone.until(lambda: phone.sent - phone.talk_at >= len(interruption),
                                  "the interruption said")
                await phone.until(lambda: len(phone.of("input_audio_buffer.committed")) ==
                                  len(phone.of("input_audio_buffer.speech_started")),
                                  "its turns committed")
        finally:
            mic.cancel()
            reader.cancel()
            await asyncio.gather(mic, reader, return_exceptions=True)
    return phone


def audio_input(**fields: Any) -> dict[str, Any]:
    return {"type": "realtime", "audio": {"input": fields}}


@pytest.mark.parametrize("noise_reduction", [None, {"type": "near_field"}], ids=["plain", "near_field"])
async def test_with_echo_cancellation_the_agent_answers_to_its_end(port: int, noise_reduction: Any) -> None:
    """Also with ``near_field`` suppression on, which keeps the front end engaged while the caller
    speaks: the echo's presence is learnt from the agent's turns only."""
    phone = await call(port, audio_input(noise_reduction=noise_reduction))
    done = phone.of("response.done")
    assert [d["response"]["status"] for d in done] == ["completed"], done
    assert len(phone.of("input_audio_buffer.speech_started")) == 1  # the question only
    assert phone.played == ANSWER_SAMPLES


async def test_without_echo_cancellation_the_agent_interrupts_itself(port: int) -> None:
    """The same call with the session's echo cancellation off: the agent's echo starts a turn while
    the answer plays, and the client, as it must, stops playing it there."""
    phone = await call(port, audio_input(echo_cancellation=False))
    assert phone.of("session.updated")[-1]["session"]["audio"]["input"]["echo_cancellation"] is False
    starts = phone.of("input_audio_buffer.speech_started")
    assert len(starts) >= 2, [e["type"] for e in phone.events]
    assert phone.played < ANSWER_SAMPLES - RATE, phone.played / RATE


@pytest.mark.parametrize("noise_reduction", [None, {"type": "near_field"}], ids=["plain", "near_field"])
async def test_the_callers_words_over_the_echo_interrupt_it(port: int, noise_reduction: Any) -> None:
    """Double talk: 1.5 s into the answer the caller speaks over its echo; the VAD hears the words
    (speech_started's onset within 300 ms of them) and the client stops the answer there; also
    with ``near_field`` suppression, whose talk gate must not take the caller for background."""
    phone = await call(port, audio_input(noise_reduction=noise_reduction), interrupt_after_s=1.5)
    assert phone.of("session.updated")[-1]["session"]["audio"]["input"]["noise_reduction"] == noise_reduction
    starts = phone.of("input_audio_buffer.speech_started")
    assert len(starts) == 2, [e["type"] for e in phone.events]
    voiced = np.flatnonzero(np.abs(speech(INTERRUPTION, RATE, 0.0, 0.5, voice="en-us+f3")) > 0.02)
    assert phone.talk_at is not None
    onset_ms = (phone.talk_at + voiced[0]) * 1000 // RATE
    assert abs(starts[1]["audio_start_ms"] - onset_ms) <= 300, (starts[1], onset_ms)
    assert phone.played < ANSWER_SAMPLES - RATE, phone.played / RATE


@pytest.mark.parametrize("noise_reduction", [None, {"type": "near_field"}], ids=["plain", "near_field"])
async def test_the_callers_words_over_the_echo_come_through_the_canceller(
        app: FastAPI, port: int, noise_reduction: Any, transcriber: Transcriber) -> None:
    """Content: the turn the caller spoke over the agent's echo, as the session handed it to the
    model (after echo cancellation, and ``near_field`` suppression), recognised offline by the
    offline preset's Whisper tiny.en, says what the caller said. The caller speaks in piper's
    voice, which Whisper tiny.en hears exactly when alone (espeak's it mishears), and at some
    length: its first words are the ones spoken over the echo, and in 6 words, one misheard word
    would weigh 0.17. Before the far end was cut where the client stopped playing, the canceller
    took the answer's unplayed rest for an echo still to come and ate the middle of the words
    ("Wait, I meant we can do the point rain on Saturday or Sunday.")."""
    pipeline = app.state.duplex.pipeline
    before = len(pipeline.requests)
    await call(port, audio_input(noise_reduction=noise_reduction), interrupt_after_s=1.5,
               interruption=natural_speech(CORRECTION, RATE, 0.0, 0.5), whole_turns=True)
    # The question's turn, then the caller's words over the echo: one turn, or more where the
    # VAD heard a pause in them (turn-taking, not what this test is about).
    turns = [request.inputs["messages"][-1] for request in pipeline.requests[before + 1:]]
    assert turns, pipeline.requests[before:]
    heard = " ".join(transcriber.transcribe(turn["audio"], turn["sample_rate"]) for turn in turns)
    assert wer(CORRECTION, heard) <= 0.35, heard
