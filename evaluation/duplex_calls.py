"""The benchmark's clients: real aiortc calls (tests/duplex's ClientPeer, connected through
``POST /v1/realtime/calls``) whose microphone says espeak-ng speech and reports when it said it.

Each phase function runs its calls to the end, hangs them up and returns what the clients saw, with
times on the monotonic clock (the same clock as the server probe's). Each call's received frames
live in its ClientPeer until the phase returns them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from duplex.media.frame_queue import TrackEvent
from duplex.media.paced_track import OutboundAudioTrack
from duplex.media.pcm import float_to_pcm16
from harness.calls import TIMEOUT, Call, audible_seconds, hang_up, wait_stages_idle
from harness.peers import ClientPeer
from harness.server import ServerProcess
from harness.speech import speech

QUESTION = "What time is it?"
INTERRUPTION = "Wait, stop."
AUDIBLE = 0.02  # a received frame louder than this (peak, full scale 1.0) carries agent audio
HEARD_BEFORE_BARGE_IN_S = 1.2  # past the session's echo guard (1 s of agent audio heard)
LATENCY_ANSWER_TOKENS = 4  # short answers keep the latency phase quick; first audio is unchanged


def trimmed(samples: np.ndarray) -> np.ndarray:
    """``samples`` without leading or trailing silence: its first and last samples are the
    moments the user starts and stops speaking."""
    loud = np.nonzero(np.abs(samples) > 0.01)[0]
    return samples[loud[0] : loud[-1] + 1]


def voiced(text: str) -> np.ndarray:
    """espeak-ng speech of ``text`` at 48 kHz, :func:`trimmed`."""
    return trimmed(speech(text, 48000, 0.0, 0.0))


@dataclass
class Utterance:
    """When the first and the last sample of something said left the client's microphone."""

    started: asyncio.Future[float]
    ended: asyncio.Future[float]


class TimedMic(OutboundAudioTrack):
    """A client microphone: the paced track (20 ms frames, silence between utterances) whose
    playout reports say when each utterance's first sample went out and when all was sent."""

    def __init__(self) -> None:
        super().__init__(on_playout=self._on_playout)
        self._ids = itertools.count()
        self._pending: dict[str, Utterance] = {}  # said, not yet sent to its end

    def say(self, samples: np.ndarray) -> Utterance:
        loop = asyncio.get_running_loop()
        item = f"say-{next(self._ids)}"
        self._pending[item] = utterance = Utterance(loop.create_future(), loop.create_future())
        self.enqueue(item, float_to_pcm16(samples))
        return utterance

    def _on_playout(self, playout: TrackEvent) -> None:
        now = time.monotonic()
        if playout.kind == "started":
            self._pending[playout.item_id].started.set_result(now)
            return
        for utterance in self._pending.values():  # the queue ran dry: everything said was sent
            utterance.ended.set_result(now)
        self._pending.clear()


class CallsEndpoint:
    """Answers a ClientPeer's offer through ``POST /v1/realtime/calls`` (all that
    ``ClientPeer.connect`` asks of a server peer) and keeps the call's path."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.path = ""

    async def answer(self, offer_sdp: str) -> str:
        async with httpx.AsyncClient() as http:
            response = await http.post(f"{self.url}/v1/realtime/calls", content=offer_sdp,
                                       headers={"Content-Type": "application/sdp"}, timeout=TIMEOUT)
        response.raise_for_status()
        self.path = response.headers["location"]
        return response.text


async def open_call(server: ServerProcess) -> Call:
    mic = TimedMic()
    peer = ClientPeer(mic)
    endpoint = CallsEndpoint(server.url)
    await peer.connect(endpoint)  # type: ignore[arg-type]  # duck-typed: only answer() is used
    call = Call(peer, mic, endpoint.path)
    await call.wait_event("session.created")
    return call


def speak(call: Call, samples: np.ndarray) -> Utterance:
    mic = call.mic
    assert isinstance(mic, TimedMic)
    return mic.say(samples)


def call_id(call: Call) -> str:
    return call.path.rsplit("/", 1)[1]


@dataclass
class ClientCall:
    """One finished call as its client saw it: frames are (arrival, peak level, pts)."""

    call_id: str
    frames: list[tuple[float, float, int]]
    turns: list[dict[str, float]] = field(default_factory=list)


def _finished(call: Call, turns: list[dict[str, float]]) -> ClientCall:
    frames = [(t, float(np.abs(s).max()), pts) for t, s, pts in call.peer.frames]
    return ClientCall(call_id(call), frames, turns)


def first_audible_after(call: Call, since: float) -> float | None:
    frames = call.peer.frames
    return next((t for t, s, _ in frames if t > since and np.abs(s).max() > AUDIBLE), None)


async def _one_turn(call: Call, number: int, question: np.ndarray) -> dict[str, float]:
    """Say ``question``, wait until the answer was played to its end; the client-side times."""
    said = speak(call, question)
    end = await said.ended
    await call.wait_event("output_audio_buffer.stopped", count=number)
    heard = first_audible_after(call, end)
    return {"speech_start": await said.started, "speech_end": end,
            "first_audio": heard if heard is not None else float("nan")}


async def _closing(server: ServerProcess, calls: list[Call]) -> None:
    await asyncio.gather(*(hang_up(server, call) for call in calls))
    await wait_stages_idle(server)


async def latency_turns(server: ServerProcess, turns: int) -> ClientCall:
    """One call, ``turns`` questions one after the other, each answered to its end."""
    call = await open_call(server)
    call.peer.send({"type": "session.update",
                    "session": {"max_output_tokens": LATENCY_ANSWER_TOKENS}})
    await call.wait_event("session.updated")
    question = voiced(QUESTION)
    records = [await _one_turn(call, n + 1, question) for n in range(turns)]
    await _closing(server, [call])
    return _finished(call, records)


async def barge_ins(server: ServerProcess, count: int) -> tuple[ClientCall, list[dict[str, Any]]]:
    """One call: a question, then ``count`` interruptions, each spoken 1.2 s into the answer to the
    previous one (an interruption is the user's next turn, so it gets an answer to interrupt).

    Returns the call and, per interruption, the client times and the server metrics scraped just
    before it and after its ``response.done`` (one session alone: the deltas are this one's).
    """
    call = await open_call(server)
    interruption = voiced(INTERRUPTION)
    speak(call, voiced(QUESTION))
    records: list[dict[str, Any]] = []
    since = time.monotonic()
    for n in range(1, count + 1):
        await call.wait_event("output_audio_buffer.started", count=n)
        await call.peer.wait_for(lambda: audible_seconds(call, since) >= HEARD_BEFORE_BARGE_IN_S)
        before = await scrape_metrics(server.url)
        said = speak(call, interruption)
        sent = await said.started
        done = await call.wait_event("response.done", count=n)
        since = time.monotonic()
        # Frames keep coming (silence): wait until the client has seen what followed the pause.
        await call.peer.wait_for(lambda: call.peer.frames[-1][0] > since + 0.3)
        after = await scrape_metrics(server.url)
        records.append({"sent": sent, "status": done["response"]["status"],
                        "silent": _silent_from(call, sent),
                        "metrics_before": before, "metrics_after": after})
        await said.ended
    await _closing(server, [call])
    return _finished(call, []), records


def _silent_from(call: Call, since: float, hold: int = 10) -> float:
    """Arrival of the first frame after ``since`` that starts ``hold`` silent frames (200 ms)."""
    frames = [(t, np.abs(s).max() <= AUDIBLE) for t, s, _ in call.peer.frames if t > since]
    for i in range(len(frames) - hold + 1):
        if all(quiet for _, quiet in frames[i : i + hold]):
            return frames[i][0]
    return float("nan")


async def concurrent_calls(server: ServerProcess, sessions: int, turns: int) -> list[ClientCall]:
    """``sessions`` calls at once, each asking ``turns`` questions in a row (all start together,
    so their answers overlap: the heaviest case for the outbound pacing)."""
    calls = await asyncio.gather(*(open_call(server) for _ in range(sessions)))
    question = voiced(QUESTION)

    async def converse(call: Call) -> list[dict[str, float]]:
        return [await _one_turn(call, n + 1, question) for n in range(turns)]

    records = await asyncio.gather(*(converse(call) for call in calls))
    await _closing(server, calls)
    return [_finished(call, turns_of) for call, turns_of in zip(calls, records)]


async def scrape_metrics(url: str) -> dict[str, float]:
    """Every sample of ``/metrics`` as ``name{label="v",...}`` → value."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics", timeout=10)).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples
