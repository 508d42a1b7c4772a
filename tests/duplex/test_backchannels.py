"""Backchannels over the agent (duplex/session/barge_in.py) against a scripted pipeline (a fake
of ``ModelPipeline``, named as such: the test decides what the recogniser heard), with the real
VAD, espeak speech and the real paced track on a virtual clock.

The agent's audio stops at the onset of any speech over it; then "yeah" lets it go on where it
paused (no cancel, no user turn), and "stop" interrupts it as before.
"""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import REGISTRY

from duplex.media.resample import Resampler
from duplex.turns.backchannel import is_backchannel
from harness.scripted_pipeline import RATE, ScriptedPipeline
from harness.speech import speech
from tests.duplex.test_session_scripted import Host, ask, tone

LONGEST_MS = 900


def backchannels_total() -> float:
    value = REGISTRY.get_sample_value("duplex_backchannels_total")
    assert value is not None, "duplex_backchannels_total is not exported"
    return value


ANSWER_S = 4.0


def sent_audio(host: Host) -> list[np.ndarray]:
    """From now on, every frame the host's track sends (mono int16, 48 kHz), in order."""
    frames: list[np.ndarray] = []
    recv = host.track.recv

    async def recording():  # type: ignore[no-untyped-def]
        frame = await recv()
        frames.append(frame.to_ndarray()[0, :: host.track.channels].copy())
        return frame

    host.track.recv = recording  # type: ignore[method-assign]
    return frames


def answer_as_sent() -> np.ndarray:
    """The answer's audio as the track sends it: resampled to 48 kHz int16 as the playout does."""
    resampler = Resampler(RATE, 48000, out_dtype=np.int16)
    return np.concatenate([resampler.push(tone(ANSWER_S)), resampler.flush()])


async def agent_speaking(backchannel_max_ms: int = LONGEST_MS) -> tuple[ScriptedPipeline, Host, str]:
    """A session whose question is answered with 4 s of audio, 1.5 s of it played: its pipeline,
    its host, and the answer's request id. ``host.sent`` holds the frames its track sent."""
    pipeline = ScriptedPipeline()
    host = Host(pipeline, backchannel_max_ms=backchannel_max_ms)
    host.sent = sent_audio(host)  # type: ignore[attr-defined]
    await ask(host, pipeline)
    answer = pipeline.requests[0].request_id
    pipeline.push(text="Paris is the capital of France. ", audio=tone(ANSWER_S), sample_rate=RATE,
                  spoken_text="Paris is the capital of France. ")
    await host.until(lambda: host.track.queued_seconds >= 3.9)
    await host.silence(75)  # past the echo guard
    return pipeline, host, answer


async def fragment_over_agent(host: Host, pipeline: ScriptedPipeline, words: str) -> str:
    """``words`` spoken over the agent, then silence until their recognition is asked for: the
    check request's id. The agent's audio is held all the while."""
    queued = host.track.queued_seconds
    await host.feed(speech(words, 16000, 0.0, 0.0))
    await host.silence(15)
    await host.until(lambda: len(pipeline.requests) == 2)
    # Only what played before the VAD heard the onset (a few 32 ms windows) left the queue.
    assert host.track.queued_seconds == pytest.approx(queued, abs=0.2), "the agent's audio went on"
    return pipeline.requests[1].request_id


@pytest.mark.parametrize("words", ["Yeah.", "Mm-hmm.", "Okay, I see.", "Uh-huh, right.", "Uh huh.",
                                   "Got it.", "NMM", "Mm-mm.", "Hmm."])
def test_listener_tokens_are_backchannels(words: str) -> None:
    assert is_backchannel(words)


@pytest.mark.parametrize("words", ["", "Stop.", "Wait.", "No.", "Yeah, but", "Okay, stop.", "Right?",
                                   "Yeah yeah yeah okay right", "What about Spain?", "I", "I see it", "H.", "Nn."])
def test_other_words_interrupt(words: str) -> None:
    assert not is_backchannel(words)


async def test_a_backchannel_lets_the_agent_go_on_where_it_paused() -> None:
    pipeline, host, answer = await agent_speaking()
    before = backchannels_total()
    check = await fragment_over_agent(host, pipeline, "Yeah.")
    request = pipeline.requests[1]
    # The check hears the fragment alone, out of the conversation, and asks for its words.
    assert request.params["transcribe"] and request.params["modalities"] == ["text"]
    assert "conversation_id" not in request.params
    assert [m["role"] for m in request.inputs["messages"] if m["role"] != "system"] == ["user"]
    queued = host.track.queued_seconds
    pipeline.push(request_id=check, input_transcript="Yeah.")
    await host.until(lambda: backchannels_total() == before + 1)
    await host.silence(25)
    assert host.track.queued_seconds < queued - 0.4, "the agent's audio did not resume"
    types = host.types()
    assert "input_audio_buffer.speech_started" not in types[types.index("response.created"):]
    assert "response.done" not in types and answer not in pipeline.aborted
    pipeline.end(answer)
    for _ in range(200):  # the 2.5 s of the answer left, and more
        if "response.done" in host.types():
            break
        await host.silence(10)
    assert "response.done" in host.types(), "the answer never ended"
    assert host.of("response.done")[0]["response"]["status"] == "completed"
    assert [i.role for i in host.session.history.items] == ["user", "assistant"]
    # What played after the pause is the rest of the answer, from where it paused: every sample
    # of the answer went out once, in order (silence only while the fragment held it).
    voiced = np.concatenate([f for f in host.sent if f.any()])  # type: ignore[attr-defined]
    whole = answer_as_sent()
    assert len(whole) <= len(voiced) < len(whole) + host.track.frame_samples, (len(voiced), len(whole))
    assert np.array_equal(voiced[: len(whole)], whole), "the answer's audio did not go on where it paused"
    await host.binding.end("test over")


async def test_words_that_are_no_backchannel_interrupt_and_become_the_next_turn() -> None:
    pipeline, host, answer = await agent_speaking()
    check = await fragment_over_agent(host, pipeline, "Stop.")
    pipeline.push(request_id=check, input_transcript="Stop.")
    await host.until(lambda: answer in pipeline.aborted)
    await host.silence(30)
    await host.until(lambda: len(pipeline.requests) == 3)
    types = host.types()
    assert host.of("response.done")[0]["response"]["status"] == "cancelled"
    assert "conversation.item.truncated" in types
    started = host.of("input_audio_buffer.speech_started")[-1]
    assert started["audio_start_ms"] < host.of("input_audio_buffer.speech_stopped")[-1]["audio_end_ms"]
    # The fragment is the user's next turn, answered after the truncated answer.
    roles = [m["role"] for m in pipeline.requests[2].inputs["messages"] if m["role"] != "system"]
    assert roles == ["user", "assistant", "user"]
    pipeline.end()
    await host.binding.end("test over")


async def test_speech_longer_than_a_backchannel_interrupts_without_asking() -> None:
    pipeline, host, answer = await agent_speaking()
    await host.feed(speech("Wait, stop, I have another question about that.", 16000, 0.0, 0.0))
    await host.until(lambda: answer in pipeline.aborted)
    assert len(pipeline.requests) == 1, "a fragment too long to be a backchannel was recognised"
    assert host.of("response.done")[0]["response"]["status"] == "cancelled"
    await host.binding.end("test over")


async def test_a_fragment_whose_words_never_come_interrupts() -> None:
    """A pipeline that does not transcribe answers the check without ``input_transcript``."""
    pipeline, host, answer = await agent_speaking()
    check = await fragment_over_agent(host, pipeline, "Yeah.")
    pipeline.push(request_id=check, text="w1 ")
    pipeline.end(check)
    await host.until(lambda: answer in pipeline.aborted)
    assert host.of("response.done")[0]["response"]["status"] == "cancelled"
    await host.binding.end("test over")


async def test_without_backchannels_a_word_interrupts_at_once() -> None:
    pipeline, host, answer = await agent_speaking(backchannel_max_ms=0)
    await host.feed(speech("Yeah.", 16000, 0.0, 0.0))
    await host.until(lambda: answer in pipeline.aborted)
    assert len(pipeline.requests) == 1, "recognised although backchannels are off"
    await host.binding.end("test over")
