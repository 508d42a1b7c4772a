"""What existing Realtime clients send, with the real ``openai`` SDK against a real server (toy
preset): ``session.update`` applied field by field, ``response.create`` options (null instructions,
metadata, out-of-band answers, also beside a running answer, the response's own input, voices),
``conversation.item.retrieve``, ``input_audio_buffer.commit`` under server_vad."""

from __future__ import annotations

import json

import numpy as np

from harness.calls import assert_subsequence
from harness.server import ServerProcess
from harness.speech import speech
from tests.api.helpers import PCM_RATE, SHORT_ANSWER, RealtimeClient, realtime, user_text

MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}


def toy_first_word(text: str) -> str:
    """The toy model's first word answering a text turn (pipeline/models/toy/runners.py)."""
    return f"w{(sum(text.encode()) % 997) * 31 % 1000}"


def transcript_of(done: object) -> str:
    return done.response.output[0].content[0].transcript  # type: ignore[attr-defined]


async def test_session_update_applies_valid_fields_and_names_each_invalid_one(server: ServerProcess) -> None:
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await rt.connection.send_raw(json.dumps({"type": "session.update", "event_id": "evt_u", "session": {
            "type": "realtime", "instructions": "Be kind.", "max_output_tokens": "inf",
            "output_modalities": ["video"], "colour": "blue", "tool_choice": "auto", "tools": tools,
            "tracing": "auto", "truncation": "auto", "include": ["item.input_audio_transcription.logprobs"],
            "prompt": {"id": "pmpt_1"},
            "audio": {"input": {"transcription": {"model": "gpt-4o-mini-transcribe"},
                                "noise_reduction": {"type": "near_field"},
                                "turn_detection": {"type": "semantic_vad", "eagerness": "high"}},
                      "output": {"voice": "marin", "speed": 9.0}}}}))
        updated = await rt.wait("session.updated")
        errors = [e.error for e in rt.of("error")]
    assert {e.param for e in errors} == {"session.output_modalities", "session.colour",
                                         "session.audio.output.speed"}, errors
    assert all(e.event_id == "evt_u" for e in errors)
    session = updated.session
    assert session.instructions == "Be kind."
    assert session.audio.output.voice == "marin"  # echoed as the client named it
    assert session.audio.output.speed == 1.0  # refused: unchanged
    assert session.output_modalities == ["audio"]
    assert session.max_output_tokens == "inf"
    assert session.tool_choice == "auto" and session.tools[0].name == "get_weather"
    assert session.tracing == "auto" and session.truncation == "auto"
    assert session.include == ["item.input_audio_transcription.logprobs"]
    assert session.prompt.id == "pmpt_1"
    assert session.audio.input.transcription.model == "gpt-4o-mini-transcribe"
    assert session.audio.input.noise_reduction.type == "near_field"
    turns = session.audio.input.turn_detection
    assert turns.type == "semantic_vad" and turns.eagerness == "high"


async def ask(rt: RealtimeClient, n: int, **response: object) -> tuple[object, object]:
    """``response.create`` with ``response``; the ``n``-th response.created and response.done."""
    await rt.connection.response.create(response=response)  # type: ignore[arg-type]
    return await rt.wait("response.created", n), await rt.wait("response.done", n)


async def test_response_create_options(server: ServerProcess) -> None:
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await rt.connection.session.update(session=MANUAL)
        await rt.wait("session.updated")
        question = "What is the weather like?"
        await rt.connection.conversation.item.create(item=user_text(question))
        user_item = (await rt.wait("conversation.item.added")).item.id

        # LiveKit's generate_reply(): null instructions (the session's) and metadata, echoed.
        created, done = await ask(rt, 1, instructions=None, metadata={"client_event_id": "ev_1"},
                                  max_output_tokens=SHORT_ANSWER)
        for response in (created.response, done.response):
            assert response.metadata == {"client_event_id": "ev_1"}
            assert response.conversation_id and response.conversation_id.startswith("conv_")
            assert response.output_modalities == ["audio"]
            assert response.audio.output.voice == "default"
            assert response.max_output_tokens == SHORT_ANSWER
        assert done.response.status == "completed"
        assert transcript_of(done).split()[0] == toy_first_word(question)
        usage = done.response.usage
        assert usage.output_tokens == SHORT_ANSWER == usage.total_tokens
        assert usage.model_extra["output_audio_seconds"] == len(rt.audio(done.response.id)) / PCM_RATE
        answer_item = done.response.output[0].id

        # Out of band, text only, with its own input: not part of the conversation.
        other = "Something else entirely"
        _, side = await ask(rt, 2, conversation="none", output_modalities=["text"], voice=None,
                            input=[user_text(other)], metadata={"topic": "side"},
                            max_output_tokens=SHORT_ANSWER)
        assert side.response.status == "completed" and side.response.conversation_id is None
        side_item = side.response.output[0]
        assert side_item.content[0].type == "output_text"
        assert side_item.content[0].text.split()[0] == toy_first_word(other)
        assert side_item.id not in [e.item.id for e in rt.of("conversation.item.added")]
        assert side_item.id not in [e.item.id for e in rt.of("conversation.item.done")]
        assert [e.delta for e in rt.of("response.output_text.delta")]
        await rt.connection.conversation.item.retrieve(item_id=side_item.id)
        missing = await rt.wait("error")
        assert missing.error.code == "item_retrieve_invalid_item_id"

        # After an assistant item: answered, in another voice.
        await rt.connection.conversation.item.retrieve(item_id=user_item)
        retrieved = await rt.wait("conversation.item.retrieved")
        assert retrieved.item.content[0].text == question
        await rt.connection.conversation.item.retrieve(item_id=answer_item)
        retrieved = await rt.wait("conversation.item.retrieved", 2)
        assert retrieved.item.content[0].transcript == transcript_of(done)
        _, third = await ask(rt, 3, audio={"output": {"voice": "cedar"}}, max_output_tokens=SHORT_ANSWER)
        assert third.response.status == "completed"
        assert third.response.audio.output.voice == "cedar"
        added = [e for e in rt.of("conversation.item.added") if e.item.id == third.response.output[0].id]
        assert added and added[0].previous_item_id == answer_item
        await rt.connection.response.create(response={"audio": {"output": {"voice": "nobody"}}})
        bad = await rt.wait("error", 2)
        assert bad.error.param == "response.audio.output.voice"
        assert len(rt.of("response.created")) == 3


async def test_an_out_of_band_text_answer_runs_beside_the_spoken_one(server: ServerProcess) -> None:
    """A client classifying the conversation while the agent answers (OpenAI's out-of-band
    responses): the text answer starts and ends while the spoken one streams, and neither touches
    the other; a second spoken answer is still refused (one voice at a time)."""
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await rt.connection.session.update(session=MANUAL)
        await rt.wait("session.updated")
        await rt.connection.conversation.item.create(item=user_text("Tell me a long story."))
        await rt.connection.response.create(response={})
        main = (await rt.wait("response.created")).response.id
        await rt.wait("response.output_audio.delta")  # the spoken answer is streaming
        await rt.connection.response.create(response={
            "conversation": "none", "output_modalities": ["text"], "metadata": {"kind": "sentiment"},
            "input": [user_text("Is the user happy?")], "max_output_tokens": SHORT_ANSWER})
        side = await rt.wait("response.done")  # the first to end: the side answer
        assert side.response.id != main and side.response.status == "completed"
        assert side.response.metadata == {"kind": "sentiment"}
        await rt.connection.response.create(response={"max_output_tokens": SHORT_ANSWER})
        refused = await rt.wait("error")
        assert refused.error.code == "conversation_already_has_active_response"
        main_done = await rt.wait("response.done", 2)
        assert main_done.response.id == main and main_done.response.status == "completed"
        items = [e.item.id for e in rt.of("conversation.item.added")]
        assert side.response.output[0].id not in items


async def test_commit_under_server_vad_ends_the_turn_the_vad_holds(server: ServerProcess) -> None:
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await rt.connection.session.update(session={"type": "realtime", "max_output_tokens": SHORT_ANSWER})
        await rt.wait("session.updated")
        # Speech with no silence after it: the VAD alone would not end the turn yet.
        await rt.append(speech("Please answer me now", PCM_RATE, 0.3, 0.0))
        await rt.wait("input_audio_buffer.speech_started")
        await rt.connection.input_audio_buffer.commit()
        committed = await rt.wait("input_audio_buffer.committed")
        done = await rt.wait("response.done")
        assert done.response.status == "completed"
        assert_subsequence(rt.types(), ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                                        "input_audio_buffer.committed", "response.created", "response.done"])
        assert committed.item_id == rt.of("input_audio_buffer.speech_started")[0].item_id
        assert not rt.of("error")
        # Nothing held now: a clear error, the session goes on.
        await rt.connection.input_audio_buffer.commit()
        error = await rt.wait("error")
        assert error.error.code == "input_audio_buffer_commit_empty"
        assert len(np.atleast_1d(rt.audio(done.response.id))) > 0


async def test_function_calling_round_trip(server: ServerProcess) -> None:
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await rt.connection.session.update(session={**MANUAL, "tools": [tool], "tool_choice": "auto"})
        await rt.wait("session.updated")
        await rt.connection.conversation.item.create(item=user_text("Weather in Paris?"))
        # The toy calls a function when the response forces one.
        _, done = await ask(rt, 1, tool_choice="required", max_output_tokens=SHORT_ANSWER)
        assert done.response.status == "completed"
        # Only the call: no message item, announced or not.
        assert [o.type for o in done.response.output] == ["function_call"]
        call = done.response.output[0]
        assert call.name == "get_weather"
        assert [e.output_index for e in rt.of("response.output_item.added")
                if e.response_id == done.response.id] == [0]
        deltas = [e.delta for e in rt.of("response.function_call_arguments.delta")]
        arguments = json.loads(call.arguments)
        assert "".join(deltas) == call.arguments and len(arguments["words"].split()) == SHORT_ANSWER
        finished = await rt.wait("response.function_call_arguments.done")
        assert (finished.call_id, finished.name, finished.arguments) == (call.call_id, "get_weather", call.arguments)
        assert call.id in [e.item.id for e in rt.of("conversation.item.added")]
        assert len(rt.audio(done.response.id)) == 0  # a call is not spoken
        # The client runs it and sends the output; the next response answers from it.
        await rt.connection.conversation.item.create(item={
            "type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
        added = await rt.wait("conversation.item.added", 3)  # user, call, output
        assert added.item.type == "function_call_output" and added.previous_item_id == call.id
        user_id = rt.of("conversation.item.added")[0].item.id
        assert rt.of("conversation.item.added")[1].previous_item_id == user_id
        _, answer = await ask(rt, 2, max_output_tokens=SHORT_ANSWER)
        assert [o.type for o in answer.response.output] == ["message"]
        assert transcript_of(answer).split()[0] == toy_first_word("(result of get_weather: sunny)")
