"""The agent's filler while a client's function runs (issue 27: calls that don't freeze the
conversation; duplex/session/call_wait.py), against a scripted pipeline (a fake of
``ModelPipeline``, named as such) with the real VAD, the real paced track on a virtual clock and
the real transport binding.

A preset that sets ``call_filler_text`` has the agent say it when a call's output is slow to come,
once per wait, and a client's ``response.create`` sent while the filler is said waits for it
instead of failing; an output that comes in time leaves the wait silent.
"""

from __future__ import annotations

import json

from harness.scripted_pipeline import ScriptedPipeline
from tests.duplex.test_session_scripted import RATE, Host, ask, tone
from tests.duplex.test_slow_function import OUTPUT, called, give_output

FILLER = "One moment, please."
AFTER_MS = 1000
FRAME_MS = 20  # Host.silence counts 20 ms frames
async def test_a_slow_call_gets_the_filler_once_and_a_response_create_waits_for_its_end() -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline, call_filler_text=FILLER, call_filler_after_ms=AFTER_MS)
    call_id = await called(host, pipeline)

    await host.silence(AFTER_MS // FRAME_MS - 10)  # not yet
    assert len(pipeline.requests) == 1
    await host.silence(15)
    await host.until(lambda: len(pipeline.requests) == 2)
    filler = pipeline.requests[1]
    assert filler.params.get("say") == FILLER
    assert FILLER in filler.inputs["messages"][0]["text"]  # the instructions ask for it too

    # The output comes while the filler is said: the client's response.create waits, no error.
    pipeline.push(text=FILLER, audio=tone(1.0), sample_rate=RATE, spoken_text=FILLER)
    await host.until(lambda: host.track.queued_seconds >= 0.9)
    give_output(host, call_id)
    await host.silence(5)
    assert not host.of("error") and len(pipeline.requests) == 2
    pipeline.end()
    await host.silence(60)  # the filler plays to its end
    await host.until(lambda: len(pipeline.requests) == 3)
    assert [d["response"]["status"] for d in host.of("response.done")] == ["completed", "completed"]
    answer = pipeline.requests[2]
    assert "say" not in answer.params
    result = answer.inputs["messages"][-1]
    assert result["role"] == "user" and OUTPUT in result["text"], result
    pipeline.push(text="It left on Tuesday.")
    pipeline.end()
    await host.until(lambda: len(host.of("response.done")) == 3)

    # Answered: no filler again, however long the caller stays quiet.
    await host.silence(2 * AFTER_MS // FRAME_MS)
    assert len(pipeline.requests) == 3 and not host.of("error")
    await host.binding.end("test over")


async def test_an_output_in_time_leaves_the_wait_silent() -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline, call_filler_text=FILLER, call_filler_after_ms=AFTER_MS)
    call_id = await called(host, pipeline)
    await host.silence(AFTER_MS // FRAME_MS // 2)
    give_output(host, call_id)
    await host.until(lambda: len(pipeline.requests) == 2)
    pipeline.push(text="It left on Tuesday.")
    pipeline.end()
    await host.until(lambda: len(host.of("response.done")) == 2)
    await host.silence(2 * AFTER_MS // FRAME_MS)
    assert len(pipeline.requests) == 2
    assert "say" not in pipeline.requests[1].params
    await host.binding.end("test over")


async def test_without_a_filler_the_wait_is_silent_and_a_busy_response_create_fails_as_before() -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline)
    await called(host, pipeline)
    await host.silence(2 * AFTER_MS // FRAME_MS)
    assert len(pipeline.requests) == 1
    await ask(host, pipeline, "And what time is it?")
    host.binding.receive(json.dumps({"type": "response.create"}))
    await host.until(lambda: bool(host.of("error")))
    assert host.of("error")[0]["error"]["code"] == "conversation_already_has_active_response"
    pipeline.end()
    await host.binding.end("test over")


async def test_the_filler_is_said_once_per_wait() -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline, call_filler_text=FILLER, call_filler_after_ms=AFTER_MS)
    await called(host, pipeline)
    await host.silence(AFTER_MS // FRAME_MS + 5)
    await host.until(lambda: len(pipeline.requests) == 2)
    pipeline.push(text=FILLER, audio=tone(0.5), sample_rate=RATE, spoken_text=FILLER)
    pipeline.end()
    await host.silence(40)  # the filler plays to its end
    await host.until(lambda: len(host.of("response.done")) == 2)
    await host.silence(3 * AFTER_MS // FRAME_MS)  # the output never comes
    assert len(pipeline.requests) == 2
    await host.binding.end("test over")
