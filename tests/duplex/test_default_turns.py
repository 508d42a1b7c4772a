"""Turn-taking defaults that never cut a speaker off: the presets that read the user's words
(offline, qwen3_omni) start every session on semantic_vad, a client that asks for server_vad gets
it, and semantic_vad without its end-of-turn model is refused at ``session.update``, naming the
package, while the rest of the update applies.

The session is the offline preset's (its session defaults, loaded as the server loads them) on the
toy pipeline, in-process and on virtual time, with the real VAD and the real end-of-turn model. The
speech is espeak-ng's plain ``en-us`` voice, which the policy was not tuned on
(evaluation/turn_utterances.py tunes on en-us+m3, en-us+f2, en-gb, ... and piper's "joe").
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import numpy as np
import pytest

from duplex.media.paced_track import OutboundAudioTrack
from duplex.media.playout import PacedPlayout
from duplex.protocol.session_update import TURN_DETECTION
from duplex.session.client_events import ClientEvents
from duplex.session.session import Session
from duplex.settings import SessionDefaults, load_preset
from duplex.turns.semantic_policy import MAX_WAIT_MS, Eagerness
from harness.speech import speech, speech_with_pauses
from pipeline.coordinator import Coordinator

STEP = 320  # 20 ms at 16 kHz


def preset_defaults(name: str) -> SessionDefaults:
    return load_preset(["--preset", name], environ={}).settings.session


class Caller:
    """A session on a preset's defaults whose transport records events; audio fed 20 ms a step,
    each step waiting for the end-of-turn model as if it answered at once."""

    kind = "webrtc"

    def __init__(self, pipeline: Coordinator, defaults: SessionDefaults) -> None:
        self.events: list[dict[str, Any]] = []
        self.clock = 0.0
        self.track = OutboundAudioTrack(clock=lambda: self.clock)
        self.session = Session("sess_default_turns", self, PacedPlayout(self.track), pipeline,
                               defaults, ["default"], "toy")
        self.client = ClientEvents(self.session)
        self.ms = 0  # audio fed so far
        self.committed_at: list[int] = []  # audio time of each committed turn

    def send_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if event["type"] == "input_audio_buffer.committed":
            self.committed_at.append(self.ms)

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    async def feed(self, audio: np.ndarray) -> None:
        for i in range(0, len(audio) - STEP + 1, STEP):
            self.session.on_audio(audio[i : i + STEP])
            self.ms += 20
            await self.session.settled()
            self.clock += 0.02
            await self.track.recv()

    async def silence(self, ms: int) -> None:
        await self.feed(np.zeros(ms * 16, dtype=np.float32))


@pytest.mark.parametrize(("preset", "kind"), [
    ("offline", "semantic_vad"), ("qwen3_omni", "semantic_vad"),
    # Test presets: toy reads no words; the tiny Qwen3-Omni transcribes only when asked and has no
    # judge of the words, and the tests that measure the framework with it count on server_vad.
    ("toy", "server_vad"), ("qwen3_omni_tiny", "server_vad"),
])
def test_presets_that_read_words_start_sessions_on_semantic_turns(preset: str, kind: str) -> None:
    assert preset_defaults(preset).session_config().turn_detection.type == kind


async def test_the_default_session_waits_through_a_pause_and_answers_a_finished_turn_once(
        pipeline: Coordinator) -> None:
    caller = Caller(pipeline, preset_defaults("offline"))
    assert caller.session.session_object()["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    # A 900 ms pause inside the sentence: server_vad's 500 ms of silence would end the turn there.
    await caller.feed(speech_with_pauses(("Could you book me a table for four people at",
                                          "seven o'clock tonight?"), (900,),
                                         pad_before_s=0.3, pad_after_s=0.0))
    assert caller.committed_at == [], "answered into the pause of an unfinished sentence"
    end_of_speech = caller.ms
    await caller.silence(MAX_WAIT_MS[Eagerness.MEDIUM] + 500)
    assert len(caller.committed_at) == 1, caller.committed_at
    assert caller.committed_at[0] - end_of_speech <= MAX_WAIT_MS[Eagerness.MEDIUM]
    assert caller.types().count("response.created") == 1
    assert "error" not in caller.types(), [e for e in caller.events if e["type"] == "error"]
    await caller.session.close()


async def test_semantic_turns_without_their_model_are_refused_at_session_update(
        pipeline: Coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    caller = Caller(pipeline, preset_defaults("offline"))
    # A client that asks for server_vad gets it (GA name, then the beta API's flat one).
    await caller.client.handle({"type": "session.update", "session": {
        "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 600}}}}})
    await caller.client.handle({"type": "session.update", "session": {
        "turn_detection": {"type": "server_vad"}}})
    assert caller.types() == ["session.updated", "session.updated"], caller.events
    turns = caller.events[-1]["session"]["audio"]["input"]["turn_detection"]
    assert (turns["type"], turns["silence_duration_ms"]) == ("server_vad", 600)

    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    with monkeypatch.context() as patch:
        patch.setattr(importlib.metadata, "distribution", not_installed)
        await caller.client.handle({"type": "session.update", "event_id": "ev_1", "session": {
            "instructions": "Be brief.", "audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}})
    error, updated = caller.events[-2:]
    assert error["type"] == "error" and updated["type"] == "session.updated", caller.events[-2:]
    assert error["error"]["param"] == TURN_DETECTION == "session.audio.input.turn_detection"
    assert error["error"]["code"] == "model_not_installed"
    assert error["error"]["event_id"] == "ev_1"
    assert "pipecat-ai" in error["error"]["message"] and "pip install" in error["error"]["message"]
    # The rest of the update applied; the turn detection stays what it was.
    assert updated["session"]["instructions"] == "Be brief."
    assert updated["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    # The session goes on taking audio: nothing fails event by event.
    errors = caller.types().count("error")
    await caller.feed(speech("What is the capital of France?", 16000, 0.3, 0.0))
    await caller.silence(800)
    assert caller.types().count("error") == errors, caller.events
    assert len(caller.committed_at) == 1
    await caller.session.close()
