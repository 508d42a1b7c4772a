"""semantic_vad in the session, on virtual time with the real VAD and the real end-of-turn model:
a pause inside an unfinished sentence does not end the turn, a finished question does, and the
maximum wait ends a turn the model doubts. The toy pipeline answers (in-process)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from duplex.media.paced_track import OutboundAudioTrack
from duplex.media.playout import PacedPlayout
from duplex.session.session import Session
from duplex.settings import SessionDefaults
from duplex.turns.config import TurnDetection
from duplex.turns.semantic_policy import MAX_WAIT_MS, Eagerness
from harness.speech import speech, speech_with_pauses
from pipeline.coordinator import Coordinator

ROOT = Path(__file__).resolve().parents[2]
STEP = 320  # 20 ms at 16 kHz


class Caller:
    """A session on semantic_vad whose transport records events; audio fed 20 ms a step."""

    kind = "webrtc"

    def __init__(self, pipeline: Coordinator, eagerness: str = "auto") -> None:
        self.events: list[dict] = []
        self.clock = 0.0
        self.track = OutboundAudioTrack(clock=lambda: self.clock)
        self.session = Session("sess_semantic", self, PacedPlayout(self.track), pipeline,
                               SessionDefaults(), ["default"], "toy")
        td = replace(TurnDetection(), type="semantic_vad", eagerness=eagerness)
        self.session.reconfigure(replace(self.session.config, turn_detection=td))
        self.ms = 0  # audio fed so far
        self.committed_at: list[int] = []  # audio time of each committed turn

    def send_event(self, event: dict) -> None:
        self.events.append(event)
        if event["type"] == "input_audio_buffer.committed":
            self.committed_at.append(self.ms)

    async def feed(self, audio: np.ndarray) -> None:
        for i in range(0, len(audio) - STEP + 1, STEP):
            self.session.on_audio(audio[i : i + STEP])
            self.ms += 20
            await self.session.settled()  # audio time waits for the model, as if it were instant
            self.clock += 0.02
            await self.track.recv()

    async def silence(self, ms: int) -> None:
        await self.feed(np.zeros(ms * 16, dtype=np.float32))


async def test_a_pause_inside_an_unfinished_sentence_does_not_end_the_turn(pipeline: Coordinator) -> None:
    caller = Caller(pipeline)
    turn = speech_with_pauses(("I would like to order a large pizza with", "mushrooms and olives."),
                              (900,), pad_before_s=0.3, pad_after_s=0.0)
    await caller.feed(turn)
    assert caller.committed_at == [], "answered into the pause"
    end_of_speech = caller.ms
    await caller.silence(MAX_WAIT_MS[Eagerness.MEDIUM] + 500)
    assert len(caller.committed_at) == 1
    assert caller.committed_at[0] - end_of_speech <= MAX_WAIT_MS[Eagerness.MEDIUM]
    await caller.session.close()


async def test_a_finished_question_ends_the_turn_before_the_maximum_wait(pipeline: Coordinator) -> None:
    caller = Caller(pipeline, eagerness="high")
    await caller.feed(speech("Could you tell me what the weather will be like tomorrow?", 16000, 0.3, 0.0))
    end_of_speech = caller.ms
    await caller.silence(MAX_WAIT_MS[Eagerness.HIGH] + 500)
    assert len(caller.committed_at) == 1
    assert caller.committed_at[0] - end_of_speech < MAX_WAIT_MS[Eagerness.HIGH], caller.committed_at
    assert "response.created" in [e["type"] for e in caller.events]
    await caller.session.close()


async def test_the_maximum_wait_ends_every_turn(pipeline: Coordinator) -> None:
    for eagerness in ("high", "low"):
        caller = Caller(pipeline, eagerness=eagerness)
        await caller.feed(speech_with_pauses(("My number is five five five",), (), pad_before_s=0.3,
                                             pad_after_s=0.0))
        end_of_speech = caller.ms
        await caller.silence(MAX_WAIT_MS[Eagerness(eagerness)] + 200)
        assert len(caller.committed_at) == 1, eagerness
        assert caller.committed_at[0] - end_of_speech <= MAX_WAIT_MS[Eagerness(eagerness)] + 200
        await caller.session.close()
