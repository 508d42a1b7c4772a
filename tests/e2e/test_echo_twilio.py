"""A caller on a speakerphone over Twilio Media Streams: the app (duplex.serve's) on a real uvicorn
server in this process, a pipeline fake that answers in espeak speech (tests/e2e/speakerphone.py),
and the Twilio client of tests/telephony/test_twilio.py (it plays what it receives on a real-time
clock, echoes each mark when its playback reaches it and drops its buffer on ``clear``) whose
microphone hears what it played ``DELAY_S`` later through a synthetic room, after the caller's
question.

Twilio plays what the server sends, so the server learns what the caller heard from the marks
(the far end's clock) and stops the agent with ``clear`` at a speech onset. With echo
cancellation (Twilio's default) the answer plays to its end with no ``clear``; with
``--no-echo-cancellation`` the agent hears itself and clears its own answer.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import websockets

from duplex.media.pcm import float_to_pcm16, pcm16_to_float, ulaw_encode
from harness.server import serving
from harness.speech import speech
from tests.e2e.speakerphone import (
    QUESTION,
    Microphone,
    SpeakingPipeline,
    answer_span_s,
    speaking_app,
    voiced_span_s,
)
from tests.telephony.test_twilio import FRAME, RATE, FakeTwilio

pytestmark = pytest.mark.e2e

DELAY_S = 0.2  # loudspeaker to microphone, and back through the network
SPEAKER_LAG_S = 0.04  # the player's 10 ms tick lays frames out this late at most, with room
TIMEOUT = 30.0


@dataclass
class SpeakerphoneTwilio(FakeTwilio):
    """Twilio's side of a call from a phone on speaker: its microphone hears, 20 ms a tick, what
    its loudspeaker played (``played``, each frame at its time) :data:`SPEAKER_LAG_S` earlier,
    through :class:`~tests.e2e.speakerphone.Microphone`, plus the caller's words (``mic.say``)."""

    # The echo's whole way back is DELAY_S, as in the other speakerphone tests.
    mic: Microphone = field(default_factory=lambda: Microphone(RATE, DELAY_S - SPEAKER_LAG_S))
    heard: list[np.ndarray] = field(default_factory=list)  # the loudspeaker, 20 ms a tick
    _echoed: int = 0  # frames of ``played`` laid out on the loudspeaker's timeline

    async def talk(self) -> None:
        loop = asyncio.get_running_loop()
        start = due = loop.time()
        # What the loudspeaker played, by time (samples since ``start``): laid out by each frame's
        # own time, so that the echo keeps one delay however the two loops' ticks fall.
        speaker = np.zeros(0, np.float32)
        lag, sent = round(SPEAKER_LAG_S * RATE), 0
        while True:
            for when, pcm in self.played[self._echoed:]:
                at = max(0, round((when - start) * RATE))
                speaker = np.pad(speaker, (0, max(0, at + len(pcm) - len(speaker))))
                speaker[at : at + len(pcm)] = pcm16_to_float(pcm)
            self._echoed = len(self.played)
            played = speaker[max(0, sent - lag) : max(0, sent - lag + FRAME)]
            played = np.pad(played, (0, FRAME - len(played)))
            self.heard.append(played)
            payload = ulaw_encode(float_to_pcm16(self.mic.hear(played)))
            await self.ws.send(json.dumps({"event": "media", "streamSid": self.sid, "media": {
                "track": "inbound", "payload": base64.b64encode(payload).decode()}}))
            sent += FRAME
            due += FRAME / RATE
            await asyncio.sleep(max(0.0, due - loop.time()))  # a microphone's pace


@contextlib.asynccontextmanager
async def twilio_speakerphone(port: int) -> AsyncIterator[SpeakerphoneTwilio]:
    """A started stream to the app on ``port``, its receiver, player and microphone running."""
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/telephony/twilio") as ws:
        phone = SpeakerphoneTwilio(ws)
        await phone.start()
        tasks = [asyncio.create_task(c()) for c in (phone.receive, phone.play, phone.talk)]
        try:
            yield phone
        finally:
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.send(json.dumps({"event": "stop", "streamSid": phone.sid}))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def quiet_for(phone: SpeakerphoneTwilio) -> float:
    """Seconds since the loudspeaker last played speech (0 before it ever did)."""
    voiced = [i for i, f in enumerate(phone.heard) if np.sqrt(np.mean(f ** 2)) > 0.015]
    return (len(phone.heard) - 1 - voiced[-1]) * FRAME / RATE if voiced else 0.0


async def call(tmp_path: Path, *options: str) -> tuple[SpeakerphoneTwilio, SpeakingPipeline]:
    """One call: the question, then the answer on the speakerphone until it ended (completed or
    cleared) and its echo had time to come back; the caller and the pipeline fake."""
    app = speaking_app(tmp_path, *options)
    pipeline: SpeakingPipeline = app.state.duplex.pipeline
    try:
        async with serving(app) as port, twilio_speakerphone(port) as phone:
            phone.mic.say(speech(QUESTION, RATE, 0.2, 0.0))
            await phone.until(lambda: pipeline.requests, TIMEOUT)
            await phone.until(lambda: quiet_for(phone) >= DELAY_S + 1.0 or len(pipeline.requests) > 1,
                              TIMEOUT)
    finally:
        await app.state.duplex.registry.close_all()
    return phone, pipeline


async def test_twilio_with_echo_cancellation_the_agent_answers_to_its_end(tmp_path: Path) -> None:
    phone, pipeline = await call(tmp_path)
    assert phone.count("clear") == 0  # not even paused for a moment
    assert not pipeline.aborted and len(pipeline.requests) == 1
    heard = voiced_span_s(phone.heard, RATE)
    assert heard >= answer_span_s(RATE) - 0.2, (heard, answer_span_s(RATE))


async def test_twilio_without_echo_cancellation_the_agent_interrupts_itself(tmp_path: Path) -> None:
    phone, pipeline = await call(tmp_path, "--no-echo-cancellation")
    assert phone.count("clear") >= 1
    assert pipeline.aborted[:1] == [pipeline.requests[0].request_id]
    heard = voiced_span_s(phone.heard, RATE)
    assert heard < answer_span_s(RATE) - 1.0, (heard, answer_span_s(RATE))
