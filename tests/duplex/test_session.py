"""The session state machine on virtual time: real silero VAD, the real toy pipeline (in-process),
the real paced outbound track driven frame by frame on a fake clock.

Each step feeds 20 ms of microphone audio and then plays one 20 ms outbound frame, so positions
(what the user heard, when the agent paused) are exact and the same on every run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import REGISTRY

from duplex.media.paced_track import OutboundAudioTrack
from duplex.media.playout import PacedPlayout
from duplex.session.client_events import ClientEvents
from duplex.session.session import Session
from duplex.settings import SessionDefaults
from harness.speech import speech
from pipeline.coordinator import Coordinator

ROOT = Path(__file__).resolve().parents[2]
STEP = 320  # 20 ms at 16 kHz
QUESTION = "Hello there. Could you tell me what the weather will be like tomorrow?"
TIMEOUT = 20.0


class Harness:
    """A session whose transport records events and whose clock moves 20 ms per step."""

    kind = "webrtc"

    def __init__(self, pipeline: Coordinator, **defaults: Any) -> None:
        self.clock = 0.0
        self.events: list[dict[str, Any]] = []
        self.track = OutboundAudioTrack(clock=lambda: self.clock)
        self.session = Session("sess_test", self, PacedPlayout(self.track), pipeline,
                               SessionDefaults(**defaults), ["default"], "toy")
        self.client = ClientEvents(self.session)
        self.played: list[np.ndarray] = []  # every outbound frame, in order
        self.session.start()

    def send_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    def first(self, kind: str) -> dict[str, Any]:
        return next(e for e in self.events if e["type"] == kind)

    async def step(self, mic: np.ndarray) -> None:
        self.session.on_audio(mic)
        self.clock += 0.02
        frame = await self.track.recv()
        self.played.append(frame.to_ndarray().reshape(-1))

    async def feed(self, audio: np.ndarray) -> None:
        for i in range(0, len(audio) - STEP + 1, STEP):
            await self.step(audio[i : i + STEP])

    async def silence(self, frames: int) -> None:
        await self.feed(np.zeros(frames * STEP, dtype=np.float32))

    async def wait(self, condition: Callable[[], Any]) -> None:
        """Let the pipeline work (real time, the virtual clock stands still) until ``condition``."""
        async with asyncio.timeout(TIMEOUT):
            while not condition():
                await asyncio.sleep(0.005)

    def audible_frames(self, start: int = 0) -> int:
        return sum(1 for f in self.played[start:] if np.abs(f).max() > 500)


async def answered(h: Harness) -> None:
    """Ask the question and wait until the whole answer is queued for playout."""
    await h.feed(speech(QUESTION, 16000, 0.3, 0.0))
    await h.silence(30)  # 600 ms: past the 500 ms end-of-turn silence
    await h.wait(lambda: "response.created" in h.types())
    await h.wait(lambda: h.session._response is not None and h.session._response.generation_done)


async def test_barge_in_pauses_at_once_and_truncates_to_what_was_heard(pipeline: Coordinator) -> None:
    h = Harness(pipeline)
    await answered(h)
    await h.silence(75)  # the agent plays 1.5 s
    heard_before = h.audible_frames()
    assert heard_before >= 70
    interruption = speech("Wait, stop, I have another question.", 16000, 0.0, 0.0)
    onset_frame = len(h.played)
    for i in range(0, 40 * STEP, STEP):  # 800 ms of the user's speech
        await h.step(interruption[i : i + STEP])
    # Paused within a few 32 ms VAD windows of the onset, and silent from then on.
    first_silent = next(i for i in range(onset_frame, len(h.played)) if np.abs(h.played[i]).max() <= 500)
    assert first_silent - onset_frame <= 6
    assert h.audible_frames(first_silent) == 0
    await h.wait(lambda: "conversation.item.truncated" in h.types())
    done = h.first("response.done")
    assert done["response"]["status"] == "cancelled"
    truncated = h.first("conversation.item.truncated")
    # What the user heard: every audible frame, up to the pause (one frame of resampler edge).
    assert abs(truncated["audio_end_ms"] - h.audible_frames() * 20) <= 20
    started = [e for e in h.events if e["type"] == "input_audio_buffer.speech_started"]
    assert len(started) == 2 and started[1]["audio_start_ms"] <= (onset_frame + 4) * 20
    types = h.types()
    assert types.index("output_audio_buffer.cleared") < types.index("response.done") \
        < types.index("conversation.item.truncated")
    # History keeps only the text whose audio had started when the user cut in.
    item = h.session.history.get(truncated["item_id"])
    assert item is not None and item.truncated_at_ms == truncated["audio_end_ms"]
    assert all(at < truncated["audio_end_ms"] for _, at in item.deltas)
    full = done["response"]["output"][0]["content"][0]["transcript"]
    assert full.startswith(item.transcript) and item.transcript
    # The whole answer was generated: the heard share of its audio keeps that share of its text.
    heard_share = truncated["audio_end_ms"] / (full.count(" ") * 3 * 80)  # 3 frames of 80 ms a word
    assert abs(len(item.transcript) / len(full) - heard_share) <= 0.1, (item.transcript, heard_share)
    stats = await pipeline.stage_stats()
    assert all(s.live_requests == 0 for s in stats.values()), stats
    await h.session.close()


async def test_false_interruption_resumes_where_it_paused(pipeline: Coordinator) -> None:
    h = Harness(pipeline)
    await answered(h)
    underruns = REGISTRY.get_sample_value("duplex_outbound_underruns_total")
    assert underruns is not None, "duplex_outbound_underruns_total is not exported"
    total = h.audible_frames() + round(h.track.queued_seconds / 0.02)  # played + still queued
    await h.silence(75)
    word = speech("Hey", 16000, 0.0, 0.0)
    start = int(np.nonzero(np.abs(word) > 0.01)[0][0])
    await h.feed(np.concatenate([word[start : start + 1600], np.zeros(STEP * 2, np.float32)]))
    paused = [i for i in range(75, len(h.played)) if np.abs(h.played[i]).max() <= 500]
    assert paused, "the click did not pause the agent"
    await h.silence(total + 20)
    await h.wait(lambda: "response.done" in h.types())
    assert h.first("response.done")["response"]["status"] == "completed"
    # Nothing was lost: every frame of the answer was played, after a short pause.
    assert abs(h.audible_frames() - total) <= 2
    assert "conversation.item.truncated" not in h.types()
    assert h.types().count("input_audio_buffer.speech_started") == 1
    # The pause is deliberate silence, and the end of the answer is its end: no underrun.
    assert REGISTRY.get_sample_value("duplex_outbound_underruns_total") == underruns
    await h.session.close()


async def test_echo_guard_raises_the_threshold_while_the_agent_is_young(pipeline: Coordinator) -> None:
    h = Harness(pipeline, echo_guard_ms=1000, echo_guard_threshold=0.9)
    await answered(h)
    await h.silence(10)
    assert h.session._detector.threshold == 0.9
    await h.silence(50)
    assert h.session._detector.threshold == 0.5
    await h.session.close()


async def test_manual_turns_and_client_errors(pipeline: Coordinator) -> None:
    h = Harness(pipeline)
    session = h.session
    await h.client.handle({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    assert h.events[-1]["type"] == "session.updated"
    assert h.events[-1]["session"]["audio"]["input"]["turn_detection"] is None
    await h.client.handle({"type": "input_audio_buffer.commit"})
    assert h.events[-1]["error"]["code"] == "input_audio_buffer_commit_empty"
    await h.client.handle({"type": "no.such.event"})
    assert h.events[-1]["error"]["code"] == "unknown_event"
    assert "no.such.event" in h.events[-1]["error"]["message"]
    # A bad field gets its own error; the rest of the update still applies (manual turns stay).
    await h.client.handle({"type": "session.update", "session": {"instructions": "Brief.", "audio": {
        "input": {"turn_detection": {"type": "magic_vad"}}}}})
    assert h.events[-2]["error"]["param"] == "session.audio.input.turn_detection.type"
    assert h.events[-1]["type"] == "session.updated"
    assert h.events[-1]["session"]["instructions"] == "Brief."
    assert h.events[-1]["session"]["audio"]["input"]["turn_detection"] is None
    await h.client.handle({"type": "response.cancel"})
    assert h.events[-1]["error"]["code"] == "response_cancel_not_active"
    await h.client.handle({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}})
    assert h.events[-1]["type"] == "conversation.item.done"
    await h.client.handle({"type": "response.create", "response": {"output_modalities": ["text"]}})
    await h.wait(lambda: "response.done" in h.types())
    done = h.first("response.done")
    assert done["response"]["status"] == "completed"
    assert "response.output_text.delta" in h.types()
    assert "response.output_audio_transcript.delta" not in h.types()
    assert h.track.queued_seconds == 0
    # A spoken turn committed by hand, then cancelled mid-response.
    session.on_audio(speech(QUESTION, 16000, 0.1, 0.1))
    await h.client.handle({"type": "input_audio_buffer.commit"})
    assert "input_audio_buffer.committed" in h.types()
    await h.client.handle({"type": "response.create"})
    await h.client.handle({"type": "response.cancel"})
    dones = [e for e in h.events if e["type"] == "response.done"]
    assert [d["response"]["status"] for d in dones] == ["completed", "cancelled"]
    stats = await pipeline.stage_stats()
    assert all(s.live_requests == 0 for s in stats.values()), stats
    await session.close()
