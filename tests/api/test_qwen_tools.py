"""Function calling through the Realtime WebSocket on the tiny Qwen3-Omni preset (random weights,
so the structure is checked, not what the model says): a forced call comes out as a silent
``function_call`` item with its argument deltas, and the call's output answers on the next turn."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.server import ServerProcess, every_stage, run_server, write_preset
from tests.api.helpers import API_KEY, realtime, user_text

MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("qwen_tools")
    # One stage process instead of the preset's two: half the startup on a 2-core machine.
    preset = write_preset(tmp / "preset.yaml", base="qwen3_omni_tiny", api_key=API_KEY,
                          stages=every_stage("qwen3_omni_tiny", process="stages"))
    with run_server(preset, tmp=tmp) as running:
        yield running


async def test_a_forced_call_round_trip(qwen_server: ServerProcess) -> None:
    async with realtime(qwen_server) as rt:
        await rt.wait("session.created")
        await rt.connection.session.update(session={**MANUAL, "tools": [WEATHER], "tool_choice": "auto"})
        await rt.wait("session.updated")
        await rt.connection.conversation.item.create(item=user_text("Weather in Paris?"))
        await rt.connection.response.create(response={
            "tool_choice": {"type": "function", "name": "get_weather"}})
        done = await rt.wait("response.done")
        assert done.response.status == "completed", done
        assert [o.type for o in done.response.output] == ["function_call"]
        call = done.response.output[0]
        assert call.name == "get_weather"
        deltas = [e.delta for e in rt.of("response.function_call_arguments.delta")]
        assert deltas and "".join(deltas) == call.arguments
        finished = rt.of("response.function_call_arguments.done")
        assert [(f.call_id, f.name, f.arguments) for f in finished] == [
            (call.call_id, "get_weather", call.arguments)]
        # The call is not words: no text of it, and no audio at all.
        assert not rt.of("response.output_audio_transcript.delta")
        assert not rt.of("response.output_audio.delta")

        await rt.connection.conversation.item.create(item={
            "type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
        added = await rt.wait("conversation.item.added", 3)  # user, call, output
        assert added.item.type == "function_call_output" and added.previous_item_id == call.id
        await rt.connection.response.create()
        answer = await rt.wait("response.done", 2)
        assert answer.response.status == "completed", answer
        assert [o.type for o in answer.response.output] == ["message"]
        assert len(rt.audio(answer.response.id)) > 0  # words again, so spoken
        assert not rt.of("error")
