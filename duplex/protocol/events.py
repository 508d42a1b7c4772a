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


def message_item(item_id: str, role: str, text: str | None) -> dict[str, Any]:
    """A completed user, system or (client-made) assistant message: its text, or else audio."""
    content = {"type": "input_text", "text": text} if text is not None else {
        "type": "input_audio", "transcript": None}
    return {"id": item_id, "object": "realtime.item", "type": "message", "status": "completed",
            "role": role, "content": [content]}


def item_added(item: dict[str, Any], previous: str | None) -> list[dict[str, Any]]:
    """The events that announce a new item after ``previous`` (GA ``added``, and ``created``)."""
    return [event("conversation.item.added", previous_item_id=previous, item=item),
            event("conversation.item.created", previous_item_id=previous, item=item)]


def assistant_item(item_id: str, speaks: bool, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_audio", "transcript": text} if speaks else {"type": "output_text", "text": text}
    return {"id": item_id, "object": "realtime.item", "type": "message", "status": status,
            "role": "assistant", "content": [part]}


def response_object(response_id: str, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None = None, reason: str | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    details: dict[str, Any] | None = None
    if status == "cancelled":
        details = {"type": "cancelled", "reason": reason or "client_cancelled"}
    elif status == "failed":
        details = {"type": "failed", "error": error}
    return {"object": "realtime.response", "id": response_id, "status": status,
            "status_details": details, "output": output, "usage": usage}
