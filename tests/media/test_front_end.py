"""The audio front end on a simulated speakerphone, on a clock of the test's own: the agent's speech
laid out by the tap as a paced transport reports it, its echo (delayed, through a synthetic room
impulse response) in the caller's audio, and white noise (duplex/media/front_end.py)."""

from __future__ import annotations

import wave
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from duplex.media import front_end_recording
from duplex.media.front_end import AudioFrontEnd
from duplex.media.marked_playout import MarkedPlayout
from duplex.media.playout import ClientPlayout
from duplex.session.config import SessionConfig
from harness.speech import speech

RATE = 16000
AGENT = ("The weather today is sunny with a light breeze from the west, and temperatures will "
         "reach twenty degrees in the afternoon.")
CHUNK = 320  # the caller's audio arrives in 20 ms packets


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Tap:
    """A downstream tap (a call's recording) that counts what it is told."""

    def __init__(self) -> None:
        self.played = 0
        self.sent = 0
        self.chunks: list[int] = []  # the length of each played chunk, in turn
        self.cuts: list[float] = []

    def agent_played(self, samples: np.ndarray, rate: int, at: float) -> None:
        self.played += len(samples)
        self.chunks.append(len(samples))

    def agent_sent(self, samples: np.ndarray, rate: int, at: float) -> None:
        self.sent += len(samples)

    def cut_agent(self, at: float) -> None:
        self.cuts.append(at)


def room(seed: int = 0, rt60_s: float = 0.2) -> np.ndarray:
    """A synthetic room impulse response: a direct path and an exponentially decaying tail."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(0.15 * RATE)) / RATE
    h = rng.standard_normal(len(t)) * np.exp(-6.9 * t / rt60_s) * 0.3
    h[0] = 1.0
    return h / np.sqrt(np.sum(h ** 2))


def config(**changes: object) -> SessionConfig:
    return replace(SessionConfig(instructions="", voice="default"), **changes)  # type: ignore[arg-type]


def speakerphone(front_end: AudioFrontEnd, clock: Clock, delay_s: float, cfg: SessionConfig,
                 near: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The agent's speech played in 20 ms frames (48 kHz, as a paced track reports them); the
    caller's microphone: its echo ``delay_s`` later at -6 dB through :func:`room`, plus ``near``.
    Returns (what the microphone picked up, what the front end made of it)."""
    agent48 = speech(AGENT, 48000, 0.0, 0.0)
    agent16 = speech(AGENT, RATE, 0.0, 0.0)
    lag = int(delay_s * RATE)
    length = max(len(agent16) + lag + RATE, 0 if near is None else len(near))
    mic = np.zeros(length, dtype=np.float32)
    mic[lag:lag + len(agent16)] += 0.5 * np.convolve(agent16, room())[: len(agent16)]
    if near is not None:
        mic[: len(near)] += near
    out = []
    for i in range(0, len(mic) - CHUNK + 1, CHUNK):
        frame = agent48[i * 3 : (i + CHUNK) * 3]
        if len(frame):
            front_end.far_end.agent_played(frame, 48000, clock.now)  # the sender takes it now
        clock.now += CHUNK / RATE
        out.append(front_end.process(mic[i : i + CHUNK], clock.now, cfg))
    processed = np.concatenate(out)
    return mic[: len(processed)], processed


def erle_db(mic: np.ndarray, out: np.ndarray, settle_s: float = 1.5) -> float:
    """Echo return loss enhancement after the canceller's first ``settle_s``."""
    start = int(settle_s * RATE)
    return float(10 * np.log10(np.mean(mic[start:] ** 2) / (np.mean(out[start:] ** 2) + 1e-12)))


def front_end(clock: Clock, record_dir: Path | None = None) -> tuple[AudioFrontEnd, ClientPlayout]:
    audio = ClientPlayout()
    recording = None if record_dir is None else str(record_dir)
    return AudioFrontEnd(audio, {"session_id": "test"}, clock=clock, record_dir=recording), audio


def read_stereo(path: Path) -> np.ndarray:
    """A 16 kHz 16-bit stereo WAV as float (samples, 2)."""
    with wave.open(str(path), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (2, 2, RATE)
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return pcm.reshape(-1, 2).astype(np.float32) / 32768.0


@pytest.mark.parametrize("delay_s", [0.1, 0.25, 0.45])
def test_the_echo_of_what_the_caller_heard_is_cancelled(delay_s: float) -> None:
    clock = Clock()
    fe, _ = front_end(clock)
    mic, out = speakerphone(fe, clock, delay_s, config())
    assert len(out) == len(mic)
    assert erle_db(mic, out) >= 20, erle_db(mic, out)


def test_without_cancellation_the_echo_stays() -> None:
    clock = Clock()
    fe, _ = front_end(clock)
    mic, out = speakerphone(fe, clock, 0.25, config(echo_cancellation=False))
    assert not fe.active
    assert np.array_equal(mic, out)


def test_the_users_speech_over_the_echo_survives() -> None:
    """Double talk: the caller's own words, spoken over the echo, pass the canceller (most of their
    energy is kept) while the echo around them is gone."""
    clock = Clock()
    fe, _ = front_end(clock)
    user = speech("Stop, please tell me about tomorrow instead.", RATE, 2.5, 0.0, voice="en-us+f3")
    mic, out = speakerphone(fe, clock, 0.25, config(), near=user)
    lead = 160 + 128  # the front end's frame and the APM's own delay
    words = slice(int(2.5 * RATE), len(user))
    kept_db = 10 * np.log10(np.mean(out[words.start + lead : words.stop + lead] ** 2)
                            / np.mean(user[words] ** 2))
    assert kept_db >= -6, kept_db
    assert erle_db(mic[:words.start], out[lead : words.start + lead]) >= 20


def test_without_an_echo_the_callers_words_over_the_agent_pass_untouched() -> None:
    """A headset, or a browser that cancelled the echo itself: nothing of the agent comes back.
    AEC3 alone would eat the first words of a caller who cuts in (it expects an echo until it
    finds one); the front end sees there is none within 60 ms of the words (it assumes an echo
    until then) and from there passes the caller's audio as it came."""
    clock = Clock()
    fe, _ = front_end(clock)
    user = speech("Stop, please tell me about tomorrow instead.", RATE, 2.5, 0.0, voice="en-us+f3")
    agent48 = speech(AGENT, 48000, 0.0, 0.0)
    out = []
    for i in range(0, len(user) - CHUNK + 1, CHUNK):
        fe.far_end.agent_played(agent48[i * 3 : (i + CHUNK) * 3], 48000, clock.now)
        clock.now += CHUNK / RATE
        out.append(fe.process(user[i : i + CHUNK], clock.now, config()))
    assert fe.engaged and fe.echo is not None and not fe.echo.presence.present
    lead = 160 + 128  # the front end's frame and AEC3's own delay
    onset = int(2.56 * RATE)  # the words begin at 2.51 s
    heard = np.concatenate(out)[onset + lead : onset + lead + int(0.4 * RATE)]
    assert np.allclose(heard, user[onset : onset + len(heard)], atol=1e-4)


def test_the_tap_passes_on_to_the_recording_set_after_it() -> None:
    """The binding adds a call's recording after the session was made, behind the front end's tap
    (``far_end.downstream``): the agent's audio reaches both, the far end first."""
    clock = Clock()
    fe, audio = front_end(clock)
    assert audio.tap is fe.far_end
    recording = Tap()
    fe.far_end.downstream = recording
    fe.process(np.zeros(CHUNK, dtype=np.float32), clock.now, config())
    assert audio.tap is fe.far_end
    audio.tap.agent_played(np.ones(960, dtype=np.int16), 48000, clock.now)
    audio.tap.agent_sent(np.ones(480, dtype=np.float32), 24000, clock.now)
    assert (recording.played, recording.sent) == (960, 480)
    assert fe.far_end.end > 0
    fe.close()
    assert audio.tap is recording


def test_client_played_audio_is_laid_out_after_what_the_client_has() -> None:
    """A Realtime WebSocket client plays chunks one after the other from the first one's sending."""
    clock = Clock()
    fe, _ = front_end(clock)
    start = fe.far_end.pos(clock.now)
    for _ in range(5):  # 5 x 100 ms sent at once, faster than real time
        fe.far_end.agent_sent(np.full(2400, 0.5, dtype=np.float32), 24000, clock.now)
    assert abs(fe.far_end.end - (start + 5 * 1600)) <= 64
    assert np.abs(fe.far_end.read(start + 7000, 160)).min() > 0.4
    assert not np.any(fe.far_end.read(start + 9000, 160))


def test_what_the_client_never_played_leaves_the_far_end() -> None:
    """A Realtime client stops playing at speech_started (``cut_agent``): the answer's unplayed
    rest is no echo to come (the canceller would suppress the caller's words under it); the next
    answer is laid out from its own sending; the recording behind is told too."""
    clock = Clock()
    fe, _ = front_end(clock)
    recording = Tap()
    fe.far_end.downstream = recording
    start = fe.far_end.pos(clock.now)
    fe.far_end.agent_sent(np.full(24000, 0.5, dtype=np.float32), 24000, clock.now)  # 1 s at once
    clock.now += 0.3
    fe.far_end.cut_agent(clock.now)
    assert recording.cuts == [clock.now]
    assert np.abs(fe.far_end.read(start + 4000, 160)).min() > 0.4  # played before the cut
    assert not np.any(fe.far_end.read(start + 4800, 3200))
    assert not fe.far_end.playing(start + 4800, start + 16000)
    clock.now += 0.2
    fe.far_end.agent_sent(np.full(2400, 0.5, dtype=np.float32), 24000, clock.now)
    assert abs(fe.far_end.end - (start + 8000 + 1600)) <= 64


def white_noise(seconds: float, level: float, seed: int = 3) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * level).astype(np.float32)


@pytest.mark.parametrize("kind", ["near_field", "far_field"])
def test_noise_reduction_suppresses_white_noise(kind: str) -> None:
    """10 dB below speech level, white noise alone: suppressed by >= 6 dB once the suppressor has
    learnt it (the first second; far_field's gain control lifts it back a little); without
    noise_reduction it passes untouched (echo cancellation alone, and no agent audio)."""
    noise = white_noise(4.0, 0.1 / 10 ** (10 / 20))
    results = {}
    for nr in (None, {"type": kind}):
        clock = Clock()
        fe, _ = front_end(clock)
        out = []
        for i in range(0, len(noise), CHUNK):
            clock.now += CHUNK / RATE
            out.append(fe.process(noise[i : i + CHUNK], clock.now, config(noise_reduction=nr)))
        tail = slice(RATE, None)
        results[kind if nr else None] = 10 * np.log10(np.mean(noise[tail] ** 2) /
                                                      np.mean(np.concatenate(out)[tail] ** 2))
    assert results[kind] >= 6, results
    assert results[None] == 0, results


def test_a_session_update_switches_processing_on_and_off() -> None:
    clock = Clock()
    fe, _ = front_end(clock)
    chunk = white_noise(0.02, 0.01)
    for cfg, active in ((config(echo_cancellation=False), False), (config(), True),
                        (config(echo_cancellation=False, noise_reduction={"type": "near_field"}), True),
                        (config(echo_cancellation=False), False)):
        clock.now += 0.02
        assert len(fe.process(chunk, clock.now, cfg)) == len(chunk)
        assert fe.active is active
        assert fe.engaged is (cfg.noise_reduction is not None)  # no agent audio: echo idles
    fe.close()
    assert not fe.active


def test_the_front_end_recording_has_the_echo_on_the_left_and_not_on_the_right(tmp_path: Path) -> None:
    """``--front-end-record-dir``: the caller's audio as it came (left) and as the VAD heard it
    (right), sample for sample on the same clock: the echo is there on the left, gone on the
    right. Off by default."""
    clock = Clock()
    fe, _ = front_end(clock, tmp_path)
    mic, out = speakerphone(fe, clock, 0.25, config())
    fe.close()
    stereo = read_stereo(tmp_path / "test.front_end.wav")
    assert len(stereo) == len(mic)
    assert np.allclose(stereo[:, 0], mic, atol=1 / 32768) and np.allclose(stereo[:, 1], out, atol=1 / 32768)
    assert erle_db(stereo[:, 0], stereo[:, 1]) >= 20
    assert front_end(Clock())[0].recording is None


def test_the_front_end_recording_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(front_end_recording, "MAX_S", 1.01)  # not a whole number of packets
    clock = Clock()
    fe, _ = front_end(clock, tmp_path)
    noise = white_noise(3.0, 0.01)
    for i in range(0, len(noise), CHUNK):
        clock.now += CHUNK / RATE
        fe.process(noise[i : i + CHUNK], clock.now, config())
    fe.close()
    assert len(read_stereo(tmp_path / "test.front_end.wav")) == int(1.01 * RATE)


def test_twilio_chunks_are_told_to_the_far_end_as_they_start() -> None:
    """A marked playout (Twilio) tells its tap each chunk as it starts playing: the first as the
    item's first mark comes back (not as it is sent: the client may start it later), each next
    one as the mark before it comes back, not at its own mark (too late for a canceller: the echo
    would come before the reference), one sent after the client played everything as it is sent;
    after a false interruption, what is sent again from the last mark is told again."""
    tap = Tap()
    sent: list[str] = []
    playout = MarkedPlayout(8000, lambda pcm: sent.append(f"media {len(pcm)}"), sent.append,
                            lambda: sent.append("clear"))
    playout.tap = tap
    playout.begin("resp", "item", "g711_ulaw")
    for size in (800, 1600, 2400):  # 100, 200 and 300 ms at 8 kHz
        playout.play(np.full(size, 0.1, dtype=np.float32), 8000)
    assert tap.chunks == []
    playout.on_mark("item:0")
    assert tap.chunks == [800]  # only the first plays yet
    playout.on_mark("item:800")
    assert tap.chunks == [800, 1600]
    playout.pause()  # a possible interruption: the second is cut as it plays
    assert tap.chunks == [800, 1600]
    playout.resume()  # a false one: sent again from the last mark, the second plays again
    assert tap.chunks == [800, 1600, 1600]
    playout.pause()  # again; the second's mark was on its way: the third was cleared unplayed
    playout.on_mark("item:2400")
    assert tap.chunks == [800, 1600, 1600]
    playout.resume()
    assert tap.chunks == [800, 1600, 1600, 2400]
    assert sent.count("clear") == 2 and sent[-2:] == ["media 2400", "item:4800"]
    playout.on_mark("item:4800")  # the client has played everything: the next plays as it comes
    playout.play(np.full(400, 0.1, dtype=np.float32), 8000)
    assert tap.chunks == [800, 1600, 1600, 2400, 400]
