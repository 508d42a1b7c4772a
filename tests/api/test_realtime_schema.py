"""Every server event of a conversation validates against the ``openai`` package's GA server-event
types (``openai.types.realtime.RealtimeServerEvent``), read as raw JSON off the WebSocket (the SDK's
own parsing does not validate). A real server (toy preset), real speech, server_vad."""

from __future__ import annotations

import asyncio
import json
from typing import Any, get_args

import websockets
from openai.types.realtime import RealtimeServerEvent
from pydantic import BaseModel, ValidationError

from harness.server import ServerProcess
from harness.speech import speech
from tests.api.helpers import API_KEY, PCM_RATE, SHORT_ANSWER, TIMEOUT, pcm16_b64, user_text


def _event_types() -> dict[str, type[BaseModel]]:
    """Each GA server event's model by its ``type`` (the union's discriminator)."""
    union = get_args(RealtimeServerEvent)[0]
    return {get_args(model.model_fields["type"].annotation)[0]: model for model in get_args(union)}


SERVER_EVENTS = _event_types()


class RawRealtime:
    """A WebSocket client that keeps every server event as the JSON the server sent."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []

    async def send(self, kind: str, **fields: Any) -> None:
        await self.ws.send(json.dumps({"type": kind, **fields}))

    async def until(self, kind: str, count: int = 1) -> dict[str, Any]:
        """Read until the ``count``-th event of ``kind`` arrived."""
        async with asyncio.timeout(TIMEOUT):
            while sum(e["type"] == kind for e in self.events) < count:
                self.events.append(json.loads(await self.ws.recv()))
        return [e for e in self.events if e["type"] == kind][count - 1]


async def test_every_event_of_a_conversation_validates(server: ServerProcess) -> None:
    url = server.url.replace("http", "ws") + "/v1/realtime?model=gpt-realtime"
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"},
                                  max_size=None) as ws:
        rt = RawRealtime(ws)
        await rt.until("session.created")
        await rt.send("session.update", session={
            "type": "realtime", "max_output_tokens": SHORT_ANSWER, "tool_choice": "auto", "tracing": None,
            "audio": {"input": {"transcription": {"model": "whisper-1"}, "noise_reduction": None},
                      "output": {"voice": "marin"}}, "no_such_field": 1})
        await rt.until("session.updated")
        # A spoken turn under server_vad, answered with audio.
        audio = speech("What will the weather be like tomorrow?", PCM_RATE, 0.3, 1.0)
        for start in range(0, len(audio), PCM_RATE // 10):
            await rt.send("input_audio_buffer.append", audio=pcm16_b64(audio[start:start + PCM_RATE // 10]))
        done = await rt.until("response.done")
        # Text items, a text answer out of band, another answer cancelled, item operations.
        await rt.send("conversation.item.create", item=user_text("And the day after?"))
        item = (await rt.until("conversation.item.added", 3))["item"]["id"]
        await rt.send("response.create", response={"conversation": "none", "output_modalities": ["text"],
                                                   "metadata": {"k": "v"}, "instructions": None})
        await rt.until("response.done", 2)
        await rt.send("response.create", response={"max_output_tokens": "inf"})
        await rt.until("response.output_audio.delta", len([e for e in rt.events
                                                            if e["type"] == "response.output_audio.delta"]) + 1)
        await rt.send("response.cancel")
        await rt.until("response.done", 3)
        # A function call and its output.
        tool = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
        await rt.send("response.create", response={"tools": [tool], "tool_choice": "required",
                                                   "output_modalities": ["text"]})
        called = await rt.until("response.done", 4)
        call_id = called["response"]["output"][0]["call_id"]
        await rt.send("conversation.item.create", item={"type": "function_call_output", "call_id": call_id,
                                                        "output": "{}"})
        await rt.until("conversation.item.done", 6)
        answer = done["response"]["output"][0]["id"]
        await rt.send("conversation.item.truncate", item_id=answer, content_index=0, audio_end_ms=100)
        await rt.until("conversation.item.truncated")
        await rt.send("conversation.item.retrieve", item_id=item)
        await rt.until("conversation.item.retrieved")
        await rt.send("conversation.item.delete", item_id=item)
        await rt.until("conversation.item.deleted")
        await rt.send("input_audio_buffer.clear")
        await rt.until("input_audio_buffer.cleared")
        await rt.send("response.cancel")  # nothing to cancel: an error event
        await rt.until("error", 2)
    kinds = {e["type"] for e in rt.events}
    assert {"input_audio_buffer.speech_started", "input_audio_buffer.committed", "response.created",
            "response.output_audio.delta", "response.output_audio_transcript.delta",
            "response.output_text.delta", "conversation.item.done", "response.done",
            "response.function_call_arguments.delta", "response.function_call_arguments.done"} <= kinds
    failures = []
    for message in rt.events:
        model = SERVER_EVENTS.get(message["type"])
        if model is None:
            failures.append(f"{message['type']} is no GA server event")
            continue
        try:
            model.model_validate(message)
        except ValidationError as err:
            failures.append(f"{message['type']}: {err}\n{json.dumps(message)[:1500]}")
    assert not failures, "\n".join(failures)
