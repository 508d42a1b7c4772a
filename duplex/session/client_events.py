"""The client events of the Realtime protocol, as one session takes them.

Each event is validated and dispatched to the Session; anything wrong (unknown type, missing or
bad fields, an action the session's state does not allow) becomes an ``error`` event that names
the problem, and the session goes on. A ClientEvents belongs to one transport binding and holds no
state of its own beyond its session; it changes the session only through the session's methods.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from duplex.protocol.events import RealtimeError, error_event, event, new_id
from duplex.protocol.session_update import apply_session_update
from duplex.protocol.wire_audio import AudioFormatError
from duplex.session.history import Item
from duplex.session.session import Session

MAX_TEXT_CHARS = 100_000


def _field(message: dict[str, Any], name: str, kind: type, required: bool = True) -> Any:
    value = message.get(name)
    if value is None:
        if required:
            raise RealtimeError(f"missing required field {name!r}", code="missing_required_parameter", param=name)
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise RealtimeError(f"field {name!r} has the wrong type", code="invalid_type", param=name)
    return value


class ClientEvents:
    def __init__(self, session: Session) -> None:
        self.session = session
        self._handlers: dict[str, Callable[[dict[str, Any]], Awaitable[None]]] = {
            "session.update": self._session_update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit,
            "input_audio_buffer.clear": self._clear,
            "conversation.item.create": self._item_create,
            "conversation.item.truncate": self._item_truncate,
            "conversation.item.delete": self._item_delete,
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
            "output_audio_buffer.clear": self._output_clear,
        }

    async def handle(self, message: Any) -> None:
        """One client event (parsed JSON); a bad one becomes an ``error`` event."""
        event_id = message.get("event_id") if isinstance(message, dict) else None
        try:
            if not isinstance(message, dict):
                raise RealtimeError("an event must be a JSON object", code="invalid_event")
            kind = message.get("type")
            handler = self._handlers.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise RealtimeError(
                    f"unknown event type {kind!r}" if kind else "the event has no type",
                    code="unknown_event" if kind else "missing_required_parameter", param="type",
                )
            await handler(message)
        except AudioFormatError as err:
            self.session.send(error_event(str(err), "invalid_audio", "audio", event_id))
        except RealtimeError as err:
            self.session.send(error_event(err.message, err.code, err.param, event_id))

    # --- handlers ---------------------------------------------------------------------------

    async def _session_update(self, message: dict[str, Any]) -> None:
        session = self.session
        config = apply_session_update(session.config, _field(message, "session", dict), session.voices)
        session.reconfigure(config)
        session.send(event("session.updated", session=session.session_object()))

    async def _append(self, message: dict[str, Any]) -> None:
        await self.session.on_wire_audio(_field(message, "audio", str))

    async def _commit(self, message: dict[str, Any]) -> None:
        if self.session.config.turn_detection is not None:
            raise RealtimeError("server_vad commits turns itself; set turn_detection to null to commit",
                                code="invalid_request")
        self.session.commit_manual_buffer()

    async def _clear(self, message: dict[str, Any]) -> None:
        self.session.clear_manual_buffer()
        self.session.send(event("input_audio_buffer.cleared"))

    async def _item_create(self, message: dict[str, Any]) -> None:
        raw = _field(message, "item", dict)
        if raw.get("type", "message") != "message":
            raise RealtimeError(f"item type {raw.get('type')!r} is not supported", param="item.type")
        role = raw.get("role")
        if role not in ("user", "assistant", "system"):
            raise RealtimeError("item.role must be user, assistant or system", param="item.role")
        content = raw.get("content")
        if not isinstance(content, list) or not content:
            raise RealtimeError("item.content must be a non-empty list", param="item.content")
        texts: list[str] = []
        audio: list[np.ndarray] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "text", "output_text"):
                texts.append(_field(part, "text", str))
            elif kind == "input_audio" and role == "user":
                audio.append(self.session.decode_wire_audio(_field(part, "audio", str)))
            else:
                raise RealtimeError(f"content type {kind!r} is not supported for {role}",
                                    param="item.content.type")
        text = "".join(texts) or None
        if text is not None and len(text) > MAX_TEXT_CHARS:
            raise RealtimeError(f"text longer than {MAX_TEXT_CHARS} characters", param="item.content")
        item_id = raw.get("id") if isinstance(raw.get("id"), str) else new_id("item")
        self.session.create_item(Item(item_id, role, text=text,
                                      audio=np.concatenate(audio) if audio else None,
                                      sample_rate=16000 if audio else None))

    async def _item_truncate(self, message: dict[str, Any]) -> None:
        item_id = _field(message, "item_id", str)
        audio_end_ms = _field(message, "audio_end_ms", int)
        item = self.session.history.get(item_id)
        if item is None or item.role != "assistant":
            raise RealtimeError(f"no assistant item {item_id!r}", code="item_not_found", param="item_id")
        if audio_end_ms < 0:
            raise RealtimeError("audio_end_ms must not be negative", param="audio_end_ms")
        self.session.truncate(item, audio_end_ms)

    async def _item_delete(self, message: dict[str, Any]) -> None:
        self.session.delete_item(_field(message, "item_id", str))

    async def _response_create(self, message: dict[str, Any]) -> None:
        overrides = _field(message, "response", dict, required=False) or {}
        allowed = {}
        if "instructions" in overrides:
            allowed["instructions"] = _field(overrides, "instructions", str)
        modalities = overrides.get("output_modalities", overrides.get("modalities"))
        if modalities is not None:
            if not isinstance(modalities, list) or not modalities \
                    or not all(isinstance(m, str) for m in modalities) or not set(modalities) <= {"text", "audio"}:
                raise RealtimeError("output_modalities must be a list of 'text' and/or 'audio'",
                                    param="response.output_modalities")
            allowed["output_modalities"] = modalities
        if isinstance(overrides.get("max_output_tokens"), int):
            allowed["max_output_tokens"] = overrides["max_output_tokens"]
        self.session.start_response(overrides=allowed)

    async def _response_cancel(self, message: dict[str, Any]) -> None:
        if not await self.session.cancel_response("client_cancelled"):
            raise RealtimeError("there is no response in progress", code="response_cancel_not_active")

    async def _output_clear(self, message: dict[str, Any]) -> None:
        self.session.audio.clear()
        await self.session.cancel_response("client_cancelled")
