"""What the speakerphone tests share (tests/e2e/test_echo_*.py): a pipeline fake that answers in
espeak speech (the toy's tones are no speech to the VAD: their echo would interrupt nothing), the
app or the server settings that serve it, the acoustic path from a loudspeaker back into the
microphone next to it, and a microphone that hears both that echo and the caller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
from aiortc import RTCSessionDescription
from fastapi import FastAPI

from duplex.app import create_app
from duplex.settings import Preset, load_preset
from duplex.transports.webrtc.ice import IcePolicy
from harness.peers import ClientPeer
from harness.scripted_pipeline import ScriptedPipeline
from harness.server import write_preset
from harness.speech import speech
from pipeline.proto import OmniRequest, OutputChunk
from tests.operators.conftest import toy_pipeline

ANSWER_RATE = 24000
ANSWER = ("Tomorrow will be sunny in the morning, with clouds in the afternoon and a light breeze "
          "from the west.")
QUESTION = "What will the weather be like tomorrow?"
INTERRUPTION = "Stop, stop. What about the weekend?"


def answer_audio() -> np.ndarray:
    return speech(ANSWER, ANSWER_RATE, 0.0, 0.1)


class SpeakingPipeline(ScriptedPipeline):
    """Answers every request with :data:`ANSWER` in espeak speech, sent as fast as it is taken,
    100 ms a chunk; an abort ends the answer. The speech is made with the fake, before any call:
    espeak runs as a blocking subprocess, which on the event loop would stall the calls' media."""

    def __init__(self) -> None:
        super().__init__()
        self._answer = answer_audio()

    async def stream(self, request: OmniRequest) -> AsyncIterator[OutputChunk]:
        self.requests.append(request)
        rid = request.request_id
        audio = self._answer
        yield OutputChunk(rid, "decode", {"text": ANSWER})
        step = ANSWER_RATE // 10
        for start in range(0, len(audio), step):
            if rid in self.aborted:
                return
            yield OutputChunk(rid, "code2wav", {"audio": audio[start:start + step],
                                                "sample_rate": ANSWER_RATE})
            await asyncio.sleep(0)


class EchoPath:
    """Loudspeaker to microphone: ``delay_s`` (the room, the device, the network both ways) and a
    synthetic room impulse response (60 ms, a direct path and an exponential tail) at -6 dB.
    ``hear`` takes what the loudspeaker played next and gives what the microphone picked up of it,
    as long; it keeps what is still on its way."""

    def __init__(self, rate: int, delay_s: float) -> None:
        rng = np.random.default_rng(7)
        t = np.arange(int(0.06 * rate)) / rate
        h = rng.standard_normal(len(t)) * np.exp(-6.9 * t / 0.15) * 0.3
        h[0] = 1.0
        self._room = (0.5 * h / np.sqrt(np.sum(h ** 2))).astype(np.float32)
        self._line = np.zeros(int(delay_s * rate), dtype=np.float32)  # played, on its way back
        self._tail = np.zeros(len(self._room) - 1, dtype=np.float32)

    @property
    def quiet(self) -> bool:
        """Whether nothing played is still on its way to the microphone."""
        return not np.any(self._line)

    def hear(self, played: np.ndarray) -> np.ndarray:
        line = np.concatenate([self._line, played.astype(np.float32)])
        arriving, self._line = line[: len(played)], line[len(played):]
        heard = np.convolve(np.concatenate([self._tail, arriving]), self._room, mode="valid")
        self._tail = np.concatenate([self._tail, arriving])[-len(self._tail):]
        return heard.astype(np.float32)


class Microphone:
    """A speakerphone's microphone, 20 ms at a time: the echo of what its loudspeaker played
    (:class:`EchoPath`) plus the caller's words (``say``), from the next frame on. With
    ``echo=False``, a handset's: the caller's words only."""

    def __init__(self, rate: int, delay_s: float, echo: bool = True) -> None:
        self.echo = EchoPath(rate, delay_s) if echo else None
        self._words = np.zeros(0, dtype=np.float32)  # the caller's, not picked up yet

    def say(self, samples: np.ndarray) -> None:
        self._words = samples.astype(np.float32)

    def hear(self, played: np.ndarray) -> np.ndarray:
        """What the microphone picks up while the loudspeaker plays ``played`` (float, as long)."""
        mic = self.echo.hear(played) if self.echo is not None else np.zeros(len(played), np.float32)
        words, self._words = self._words[: len(mic)], self._words[len(mic):]
        mic[: len(words)] += words
        return mic


def voiced_span_s(frames: list[np.ndarray], rate: int, level: float = 0.015,
                  gap_s: float = 0.6) -> float:
    """How long the first stretch of speech in ``frames`` (consecutive float frames) lasts, from
    its first frame above ``level`` (RMS) to its last, pauses shorter than ``gap_s`` included."""
    loud = [i for i, f in enumerate(frames) if len(f) and np.sqrt(np.mean(f ** 2)) > level]
    if not loud:
        return 0.0
    end = loud[0]
    for i in loud[1:]:
        if sum(len(f) for f in frames[end + 1 : i]) > gap_s * rate:
            break
        end = i
    return sum(len(f) for f in frames[loud[0] : end + 1]) / rate


def answer_span_s(rate: int) -> float:
    """The agent's answer's own span, measured as a caller's hearing of it is (20 ms frames at
    ``rate``): what a call that lets it play to its end hears."""
    answer = speech(ANSWER, rate, 0.0, 0.1)
    frame = rate // 50
    return voiced_span_s([answer[i : i + frame] for i in range(0, len(answer), frame)], rate)


def speaking_preset(tmp: Path, *options: str) -> Preset:
    """The toy preset with server_vad turns (and ``options``, the command line's), whose pipeline
    a :class:`SpeakingPipeline` replaces: never started."""
    path = write_preset(tmp / "preset.yaml", pipeline=toy_pipeline(), pipeline_mode="inproc",
                        session={"turn_detection": {"type": "server_vad"}})
    return load_preset(["--config", str(path), *options], environ={})


def speaking_app(tmp: Path, *options: str) -> FastAPI:
    """duplex.serve's app on :func:`speaking_preset`, answering with a :class:`SpeakingPipeline`
    (``app.state.duplex.pipeline``); serve it without its lifespan, which would start the toy."""
    app = create_app(speaking_preset(tmp, *options), IcePolicy(hosts=("127.0.0.1",)))
    app.state.duplex.pipeline = SpeakingPipeline()
    return app


async def dial(http: httpx.AsyncClient, peer: ClientPeer) -> str:
    """A WebRTC call to the app behind ``http`` (``POST /v1/realtime/calls`` with ``peer``'s
    offer), once its session was created; the call's id."""
    answer = await http.post("/v1/realtime/calls", content=await peer.offer(),
                             headers={"Content-Type": "application/sdp"})
    assert answer.status_code == 201, answer.text
    await peer.pc.setRemoteDescription(
        RTCSessionDescription(peer.policy.filter_candidates(answer.text), "answer"))
    await peer.wait_for(lambda: any(e["type"] == "session.created" for e in peer.events()))
    return str(answer.headers["location"].rsplit("/", 1)[1])
