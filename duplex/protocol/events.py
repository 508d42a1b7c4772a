"""The OpenAI Realtime protocol (GA event names): builders for server events, items and responses.

Shared by every transport that speaks the protocol (the WebRTC ``oai-events`` data channel, the
``/v1/realtime`` WebSocket). Pure functions: nothing here keeps state.
"""

from __future__ import annotations

import uuid
from typing import Any


class RealtimeError(Exception):
    """A client event the session cannot take; reported as an ``error`` event, session kept."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(message: str, code: str, param: str | None = None, event_id: str | None = None,
                kind: str = "invalid_request_error") -> dict[str, Any]:
    return event("error", error={
        "type": kind, "code": code, "message": message, "param": param, "event_id": event_id,
    })


def message_item(item_id: str, role: str, text: str | None, audio: bool = False) -> dict[str, Any]:
    """A completed user, system or (client-made) assistant message: its text, or its audio with the
    transcript where known."""
    content = {"type": "input_audio", "transcript": text} if audio else {
        "type": "output_text" if role == "assistant" else "input_text", "text": text or ""}
    return {"id": item_id, "object": "realtime.item", "type": "message", "status": "completed",
            "role": role, "content": [content]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "function_call", "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}


def function_call_output_item(item_id: str, call_id: str, output: str) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "function_call_output", "status": "completed",
            "call_id": call_id, "output": output}


def item_added(item: dict[str, Any], previous: str | None) -> list[dict[str, Any]]:
    """The events that announce a new item after ``previous`` (GA ``added``, and ``created``)."""
    return [event("conversation.item.added", previous_item_id=previous, item=item),
            event("conversation.item.created", previous_item_id=previous, item=item)]


def assistant_item(item_id: str, speaks: bool, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_audio", "transcript": text} if speaks else {"type": "output_text", "text": text}
    return {"id": item_id, "object": "realtime.item", "type": "message", "status": status,
            "role": "assistant", "content": [part]}


def format_object(kind: str) -> dict[str, Any]:
    """An audio format as the GA session and response objects carry it."""
    return {"type": kind, "rate": 24000} if kind == "audio/pcm" else {"type": kind}


def usage_object(input_tokens: int, output_tokens: int, input_audio_s: float,
                 output_audio_s: float, cached_tokens: int = 0) -> dict[str, Any]:
    """``response.usage``: token counts (the model's where it reports them; ``cached_tokens``:
    input tokens whose KV the model kept from the conversation's earlier turns) and, beyond
    OpenAI's fields, the seconds of audio the model heard and spoke."""
    return {"total_tokens": input_tokens + output_tokens, "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "input_token_details": {"text_tokens": input_tokens, "audio_tokens": 0,
                                    "cached_tokens": cached_tokens},
            "output_token_details": {"text_tokens": output_tokens, "audio_tokens": 0},
            "input_audio_seconds": round(input_audio_s, 3), "output_audio_seconds": round(output_audio_s, 3)}


def response_object(response_id: str, status: str, output: list[dict[str, Any]], *,
                    conversation_id: str | None, modalities: tuple[str, ...], audio_format: str,
                    voice: str, max_output_tokens: int | None, metadata: dict[str, str] | None,
                    usage: dict[str, Any] | None = None, reason: str | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    details: dict[str, Any] | None = None
    if status == "cancelled":
        details = {"type": "cancelled", "reason": reason or "client_cancelled"}
    elif status == "failed":
        details = {"type": "failed", "error": error}
    return {"object": "realtime.response", "id": response_id, "status": status,
            "status_details": details, "output": output, "conversation_id": conversation_id,
            "output_modalities": ["audio"] if "audio" in modalities else ["text"],
            "audio": {"output": {"format": format_object(audio_format), "voice": voice}},
            "max_output_tokens": "inf" if max_output_tokens is None else max_output_tokens,
            "metadata": metadata, "usage": usage}
