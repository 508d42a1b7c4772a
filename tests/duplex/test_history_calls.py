"""What the model gets of function calls and their results: structured fields beside the plain
text, and a call joined to the assistant words before it (one answer, one message); the tools
offered are part of what kept model state continues."""

from __future__ import annotations

from typing import Any

from duplex.session.history import FunctionCall, History, Item
from duplex.session.model_state import KeptModelState
from harness.scripted_pipeline import ScriptedPipeline


def test_calls_and_results_carry_their_fields_beside_the_text() -> None:
    history = History(60)
    history.add(Item("u", "user", text="Weather in Paris?"))
    history.add(Item("a", "assistant", text="Let me see."))
    history.add(Item("c", "assistant", call=FunctionCall("call_1", "get_weather", '{"city": "Paris"}')))
    history.add(Item("c2", "assistant", call=FunctionCall("call_2", "get_time", "{}")))
    history.add(Item("o", "user", call=FunctionCall("call_1", "get_weather", output="sunny")))
    history.add(Item("o2", "user", call=FunctionCall("call_2", "get_time", output="noon")))
    question, answer, result, second = history.messages(None)
    assert question == {"role": "user", "text": "Weather in Paris?", "audio": None, "sample_rate": None}
    # The words and both calls made one answer: one assistant message.
    assert answer["role"] == "assistant" and answer["words"] == "Let me see."
    assert answer["tool_calls"] == [
        {"call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"call_id": "call_2", "name": "get_time", "arguments": "{}"},
    ]
    assert answer["text"] == ('Let me see. (calling get_weather with {"city": "Paris"}) '
                              "(calling get_time with {})")
    assert result["tool_result"] == {"call_id": "call_1", "name": "get_weather", "output": "sunny"}
    assert result["text"] == "(result of get_weather: sunny)" and result["role"] == "user"
    assert second["tool_result"]["output"] == "noon"
    # The items themselves are untouched: the join is the messages' alone.
    assert history.get("a").call is None and history.get("a").text == "Let me see."


def test_a_call_with_no_words_before_it_is_a_message_of_its_own() -> None:
    history = History(60)
    history.add(Item("u", "user", text="Weather?"))
    history.add(Item("c", "assistant", call=FunctionCall("call_1", "get_weather", "{}")))
    _, call = history.messages("Be brief.")[1:]
    assert call["words"] is None and call["tool_calls"][0]["call_id"] == "call_1"
    assert call["text"] == "(calling get_weather with {})"


async def test_kept_model_state_is_continued_only_with_the_same_tools() -> None:
    """The model's prompt carries the tools: other tools start a new kept conversation."""
    pipeline = ScriptedPipeline()
    state = KeptModelState(pipeline, enabled=True)
    weather = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
    time_of_day = {"type": "function", "name": "time", "parameters": {"type": "object"}}

    def turn(n: int) -> list[dict[str, Any]]:
        return [{"role": "user", "text": f"question {n}", "audio": None},
                {"role": "assistant", "text": f"answer {n}", "audio": None}]

    first = state.conversation_for(turn(1)[:1], [weather])["conversation_id"]
    assert state.conversation_for([*turn(1), *turn(2)[:1]], [weather])["conversation_id"] == first
    other = state.conversation_for([*turn(1), *turn(2), *turn(3)[:1]], [time_of_day])["conversation_id"]
    assert other != first
    await state.close()
    assert pipeline.closed_conversations == [first, other]
