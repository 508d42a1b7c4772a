"""A client function whose output comes late (issue 27: calls that don't freeze the conversation),
against a scripted pipeline (a fake of ``ModelPipeline``, named as such) with the real VAD, the
real paced track on a virtual clock and the real transport binding.

The model calls the client's function and its response ends; for five seconds no output comes.
Meanwhile the caller asks something else and is answered aloud, talks over that answer (a barge-in
that cancels it), and only then does the function's output arrive: the next response answers it,
with the call and its output in what the model is given.
"""

from __future__ import annotations

import json

from harness.scripted_pipeline import ScriptedPipeline
from harness.speech import speech
from tests.duplex.test_session_scripted import RATE, Host, ask, tone

OUTPUT = "Order 4417 left the warehouse on Tuesday."
TOOLS = {"type": "session.update", "session": {"type": "realtime", "tools": [
    {"type": "function", "name": "find_order", "description": "Where an order is",
     "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}}]}}


async def called(host: Host, pipeline: ScriptedPipeline) -> str:
    """The caller asks, the model calls ``find_order`` and its response ends; the call's id."""
    host.binding.receive(json.dumps(TOOLS))
    await host.until(lambda: "session.updated" in host.types())
    await ask(host, pipeline, "Where is my order?")
    pipeline.push(function_call={"name": "find_order", "arguments": '{"id": 4417}'})
    pipeline.end()
    await host.until(lambda: "response.done" in host.types())
    (call,) = [i for i in host.of("response.done")[0]["response"]["output"] if i["type"] == "function_call"]
    return str(call["call_id"])


def give_output(host: Host, call_id: str) -> None:
    host.binding.receive(json.dumps({"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": call_id, "output": OUTPUT}}))
    host.binding.receive(json.dumps({"type": "response.create"}))


async def test_a_late_function_output_is_answered_and_the_call_meanwhile_goes_on() -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline)
    call_id = await called(host, pipeline)

    # Five seconds without the output: the session listens, and answers another question aloud.
    await host.silence(250)
    assert host.session.response is None and not host.of("error")
    await ask(host, pipeline, "And what time is it?")
    assert len(pipeline.requests) == 2
    pipeline.push(text="It is noon. ", audio=tone(3.0), sample_rate=RATE, spoken_text="It is noon. ")
    await host.until(lambda: host.track.queued_seconds >= 2.9)
    await host.silence(75)  # 1.5 s of it heard, past the echo guard
    # The caller talks over it: the answer is cut, its request aborted.
    await host.feed(speech("Wait, never mind that.", 16000, 0.0, 0.0))
    await host.until(lambda: pipeline.requests[1].request_id in pipeline.aborted)
    assert host.track.queued_seconds == 0  # the rest of the answer is not played
    await host.silence(30)
    await host.until(lambda: len(pipeline.requests) == 3)
    pipeline.push(text="Sure.")
    pipeline.end()
    await host.until(lambda: len(host.of("response.done")) == 3)
    assert [d["response"]["status"] for d in host.of("response.done")] == ["completed", "cancelled", "completed"]

    # The output, at last: answered by the next response, the call and its output given to it.
    give_output(host, call_id)
    await host.until(lambda: len(pipeline.requests) == 4)
    messages = pipeline.requests[3].inputs["messages"]
    assert any(call_id in json.dumps(m.get("tool_calls", "")) for m in messages), messages
    result = messages[-1]
    assert result["role"] == "user" and OUTPUT in result["text"], result
    pipeline.push(text="It left on Tuesday.")
    pipeline.end()
    await host.until(lambda: len(host.of("response.done")) == 4)
    assert host.of("response.done")[3]["response"]["status"] == "completed"
    await host.binding.end("test over")
