"""Idle and length limits (duplex/session/idle.py) on virtual time: real silero VAD, the toy
pipeline in-process, the paced track driven a frame at a time on a fake clock (the harness of
tests/duplex/test_session.py). Each step is 20 ms of the caller's audio and 20 ms of the agent's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from duplex.turns.config import TurnDetection
from harness.speech import speech
from tests.duplex.test_session import QUESTION, Harness, answered
from tests.operators.conftest import SpyPipeline

IDLE_MS = 5000  # OpenAI's shortest idle_timeout_ms
WINDOW_MS = 32  # the VAD's window: where the detector's position moves
ANSWER = "Yes, I am still here."


def idle(**changes: Any) -> TurnDetection:
    return TurnDetection(idle_timeout_ms=IDLE_MS, **changes)


async def silence_until(h: Harness, condition: Callable[[], Any], limit_frames: int) -> int:
    """Step silence until ``condition``; returns the frames stepped. Any response that begins is
    let generate in full first (real time; the virtual clock stands still), so what plays when is
    the same on every run."""
    for frame in range(limit_frames):
        if condition():
            return frame
        response = h.session.response
        if response is not None and not response.generation_done:
            await h.wait(lambda: h.session.response is None or h.session.response.generation_done)
        await h.silence(1)
    assert condition(), f"not within {limit_frames} frames: {h.types()[-8:]}"
    return limit_frames


def position(h: Harness) -> int:
    return h.session._detector.position_ms


def count(h: Harness, kind: str) -> int:
    return h.types().count(kind)


async def test_timeout_fires_after_the_silence_never_during_the_agents_audio(make_pipeline) -> None:
    pipeline: SpyPipeline = await make_pipeline(30)  # 30 words: 7.2 s of the agent's audio
    h = Harness(pipeline, turn_detection=idle())
    await answered(h)
    done_frames = await silence_until(h, lambda: "response.done" in h.types(), 500)
    # The agent spoke longer than the timeout, and nothing timed out meanwhile.
    assert done_frames * 20 > IDLE_MS + 1000
    assert count(h, "input_audio_buffer.timeout_triggered") == 0
    done_at = position(h)
    await silence_until(h, lambda: "input_audio_buffer.timeout_triggered" in h.types(), 400)
    fired_at = position(h)
    assert IDLE_MS <= fired_at - done_at <= IDLE_MS + 2 * WINDOW_MS
    timeout = h.first("input_audio_buffer.timeout_triggered")
    assert abs(timeout["audio_start_ms"] - done_at) <= WINDOW_MS
    assert IDLE_MS <= timeout["audio_end_ms"] - timeout["audio_start_ms"] < IDLE_MS + WINDOW_MS
    # As OpenAI: the silence is committed as the timeout's item, and a response answers it.
    types = h.types()
    after = types[types.index("input_audio_buffer.timeout_triggered"):]
    assert after.index("input_audio_buffer.committed") < after.index("response.created")
    committed = next(e for e in h.events if e["type"] == "input_audio_buffer.committed"
                     and e["item_id"] == timeout["item_id"])
    assert committed
    await h.session.close()


async def test_no_timeout_while_the_caller_speaks(make_pipeline) -> None:
    pipeline = await make_pipeline()
    h = Harness(pipeline, turn_detection=idle(create_response=False))
    # 4 s of silence, a sentence, then 4 s of silence: never 5 s of silence in a row.
    await h.silence(200)
    await h.feed(speech(QUESTION, 16000, 0.0, 0.0))
    await h.silence(200)
    assert count(h, "input_audio_buffer.speech_stopped") == 1
    assert count(h, "input_audio_buffer.timeout_triggered") == 0
    await silence_until(h, lambda: "input_audio_buffer.timeout_triggered" in h.types(), 120)
    timeout = h.first("input_audio_buffer.timeout_triggered")
    # The silence counts from where the turn closed.
    assert abs(timeout["audio_start_ms"] - h.first("input_audio_buffer.speech_stopped")["audio_end_ms"]) <= WINDOW_MS
    assert IDLE_MS <= position(h) - timeout["audio_start_ms"] < IDLE_MS + WINDOW_MS
    assert "response.created" not in h.types()  # create_response false: no answer
    await h.session.close()


async def test_an_answered_check_in_keeps_the_call(make_pipeline) -> None:
    pipeline = await make_pipeline()
    h = Harness(pipeline, turn_detection=idle(), check_ins=1, check_in_text="Hello, anybody there?")
    hangups: list[str] = []
    h.session.idle.hang_up = hangups.append
    await silence_until(h, lambda: "response.done" in h.types(), 400)
    assert count(h, "input_audio_buffer.timeout_triggered") == 1
    assert 'say exactly this, and nothing more: "Hello, anybody there?"' in pipeline.instructions()[-1]
    assert pipeline.said() == ["Hello, anybody there?"]  # for models that speak given words
    # The caller answers the check-in, and is answered.
    await h.feed(speech(ANSWER, 16000, 0.3, 0.0))
    await silence_until(h, lambda: count(h, "response.done") == 2, 400)
    assert "Hello, anybody there?" not in pipeline.instructions()[-1]
    assert pipeline.said()[-1] is None
    # Silent again: another check-in, not the end of the call (the answer reset the count).
    await silence_until(h, lambda: count(h, "input_audio_buffer.timeout_triggered") == 2, 400)
    await silence_until(h, lambda: count(h, "response.done") == 3, 400)
    assert "Hello, anybody there?" in pipeline.instructions()[-1]
    assert h.session.idle.ending is None and not hangups
    await h.session.close()


async def test_unanswered_check_ins_end_the_call(make_pipeline) -> None:
    pipeline = await make_pipeline()
    h = Harness(pipeline, turn_detection=idle(), check_ins=2, idle_goodbye_text="Bye for now.")
    hangups: list[tuple[str, int]] = []  # (reason, response.done events sent by then)
    h.session.idle.hang_up = lambda reason: hangups.append((reason, count(h, "response.done")))
    await silence_until(h, lambda: h.session.idle.ending is not None, 1500)
    # Two check-ins asked, a third timeout: the goodbye, said in full, then the hang-up.
    assert count(h, "input_audio_buffer.timeout_triggered") == 3
    said = pipeline.instructions()
    assert len(said) == 3
    assert all("Are you still there?" in text for text in said[:2])
    assert "Bye for now." in said[2]
    assert not hangups
    await silence_until(h, lambda: hangups, 400)
    done = [e for e in h.events if e["type"] == "response.done"]
    assert len(done) == 3 and done[-1]["response"]["status"] == "completed"
    assert hangups == [("the caller did not answer the check-ins", 3)]  # after the goodbye
    await h.session.close()


async def test_longest_call_cancels_says_the_closing_line_then_hangs_up(make_pipeline) -> None:
    pipeline = await make_pipeline(30)
    h = Harness(pipeline, max_call_s=6.0, closing_text="Time is up, goodbye.")
    hangups: list[tuple[str, int]] = []  # (reason, response.done events sent by then)
    h.session.idle.hang_up = lambda reason: hangups.append((reason, count(h, "response.done")))
    await answered(h)  # the question ends at ~3.8 s; the answer plays 7.2 s
    await silence_until(h, lambda: h.session.idle.ending is not None, 400)
    assert 6000 <= position(h) <= 6000 + 2 * WINDOW_MS
    await silence_until(h, lambda: count(h, "response.done") == 2, 600)
    first, closing = [e["response"] for e in h.events if e["type"] == "response.done"]
    assert first["status"] == "cancelled"
    assert "Time is up, goodbye." in pipeline.instructions()[-1]
    assert pipeline.said()[-1] == "Time is up, goodbye."
    await silence_until(h, lambda: hangups, 50)
    # The closing line was played in full (its response.done comes after its last frame), then
    # the hang-up.
    assert closing["status"] == "completed"
    assert hangups == [("the call reached its maximum length", 2)]
    audible = [i for i, f in enumerate(h.played) if np.abs(f).max() > 500]
    assert len(h.played) - 1 - audible[-1] <= 5
    await h.session.close()
