"""The audio front end in a real Session (real VAD and turn detection; a scripted pipeline fake
stands in for the model): ``audio.input.noise_reduction`` and ``echo_cancellation`` as a client
sets them, and the server's ``--[no-]echo-cancellation``."""

from __future__ import annotations

import time
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from duplex.media.playout import ClientPlayout
from duplex.protocol.session_update import apply_session_update
from duplex.session.session import Session
from duplex.settings import SessionDefaults, load_preset
from harness.scripted_pipeline import ScriptedPipeline
from harness.speech import speech
from tests.media.test_front_end import Tap

RATE = 16000
STEP = 320
QUESTION = "What time does the library open tomorrow morning?"


class Host:
    """A Realtime WebSocket-like transport that records the events."""

    kind = "websocket"

    def __init__(self, **defaults: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self.session = Session("sess_front_end", self, ClientPlayout(), ScriptedPipeline(),
                               SessionDefaults(**defaults), ["default"], "scripted")
        self.session.start()

    def send_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def update(self, audio_input: dict[str, Any]) -> None:
        config, errors = apply_session_update(self.session.config, {"audio": {"input": audio_input}},
                                              ["default"])
        assert not errors, errors
        self.session.reconfigure(config)

    def feed(self, audio: np.ndarray, start: float = 0.0) -> None:
        for i in range(0, len(audio) - STEP + 1, STEP):
            self.session.on_audio(audio[i : i + STEP], start + (i + STEP) / RATE)


def level_db(samples: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(np.square(samples, dtype=np.float64)) + 1e-12))


@pytest.mark.parametrize("reduction", [None, "near_field"])
async def test_noise_reduction_cleans_what_the_turn_holds(reduction: str | None) -> None:
    """White noise 10 dB below the speech, 2 s of it alone and then under a question: no turn in
    the noise alone, one turn for the question, and with ``near_field`` the audio that turn holds
    (the VAD's prefix padding, noise only, before the words) is >= 6 dB quieter than the noise."""
    host = Host(turn_detection={"type": "server_vad", "create_response": False})
    host.update({"noise_reduction": None if reduction is None else {"type": reduction}})
    question = speech(QUESTION, RATE, 2.0, 1.0)
    voiced = np.abs(question) > 0.01
    noise_level = np.sqrt(np.mean(question[voiced] ** 2)) / 10 ** (10 / 20)
    noise = np.random.default_rng(5).standard_normal(len(question)).astype(np.float32) * noise_level
    host.feed(noise[: 2 * RATE])
    assert not host.of("input_audio_buffer.speech_started")
    host.feed((question + noise)[2 * RATE :], start=2.0)
    assert len(host.of("input_audio_buffer.committed")) == 1
    turn = next(i for i in host.session.history.items if i.role == "user")
    lead_in = turn.audio[: int(0.2 * RATE)]  # the prefix padding: noise before the words
    reduced_db = level_db(noise) - level_db(lead_in)
    if reduction is None:
        assert abs(reduced_db) <= 1, reduced_db
    else:
        assert reduced_db >= 6, reduced_db
    await host.session.close()


async def test_the_session_turns_echo_cancellation_off_and_says_so() -> None:
    host = Host()
    assert host.session.session_object()["audio"]["input"]["echo_cancellation"] is True
    host.feed(np.zeros(STEP, dtype=np.float32))
    assert host.session.front_end.echo is not None
    host.update({"echo_cancellation": False})
    host.feed(np.zeros(STEP, dtype=np.float32), start=0.02)
    assert host.session.front_end.echo is None
    assert host.session.session_object()["audio"]["input"]["echo_cancellation"] is False
    _, errors = apply_session_update(host.session.config,
                                     {"audio": {"input": {"echo_cancellation": "off"}}}, ["default"])
    assert [e.param for e in errors] == ["session.audio.input.echo_cancellation"]
    await host.session.close()
    assert host.session.audio.tap is None


async def test_the_server_setting_is_every_sessions_default() -> None:
    defaults = load_preset(["--preset", "toy", "--no-echo-cancellation"], environ={}).settings.session
    host = Host(**defaults.model_dump(exclude={"voice_map"}))
    host.feed(np.zeros(STEP, dtype=np.float32))
    assert host.session.config.echo_cancellation is False and host.session.front_end.echo is None
    default = load_preset(["--preset", "toy"], environ={}).settings.session
    assert default.echo_cancellation is None and default.session_config().echo_cancellation is True
    assert default.session_config("webrtc").echo_cancellation is False  # browsers cancel their own
    await host.session.close()


async def test_the_server_option_records_each_sessions_front_end(tmp_path: Path) -> None:
    defaults = load_preset(["--preset", "toy", "--front-end-record-dir", str(tmp_path)],
                           environ={}).settings.session
    assert defaults.front_end_record_dir == str(tmp_path)
    assert load_preset(["--preset", "toy"], environ={}).settings.session.front_end_record_dir is None
    host = Host(**defaults.model_dump(exclude={"voice_map"}))
    host.feed(np.full(RATE, 0.25, dtype=np.float32))
    await host.session.close()
    with wave.open(str(tmp_path / "sess_front_end.front_end.wav"), "rb") as w:
        assert (w.getnchannels(), w.getnframes()) == (2, RATE - RATE % STEP)


async def test_a_realtime_client_stops_playing_at_speech_started() -> None:
    """A WebSocket client was sent 10 s of an answer at once; the caller speaks: with
    speech_started the client stops playing (its duty), so the rest leaves the echo canceller's
    far end and the call's recording (the tap behind it) is told."""
    host = Host(turn_detection={"type": "server_vad", "create_response": False})
    far_end = host.session.front_end.far_end
    recording = Tap()
    far_end.downstream = recording
    host.session.audio.begin("resp_1", "item_1", "audio/pcm")
    host.session.audio.play(np.full(10 * 24000, 0.1, dtype=np.float32), 24000)
    assert far_end.end > far_end.pos(time.monotonic()) + 8 * 16000
    host.feed(speech(QUESTION, RATE, 0.5, 1.0))
    assert host.of("input_audio_buffer.speech_started")
    assert len(recording.cuts) == 1
    assert far_end.end <= far_end.pos(time.monotonic())
    await host.session.close()
