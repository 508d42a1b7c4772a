"""The OpenAI Realtime protocol (GA event names): session configuration, items and events.

Shared by both realtime transports (the WebRTC ``oai-events`` data channel and the ``/v1/realtime``
WebSocket): builders for the server events and objects, and the validation of ``session.update``.
Nothing here keeps state beyond one call, except ``SessionConfig``, which belongs to one session.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from duplex.settings import SessionDefaults

AUDIO_FORMATS = {"audio/pcm", "audio/pcmu", "audio/pcma"}
MODALITY_SETS = ({"audio"}, {"text"}, {"text", "audio"})


class RealtimeError(Exception):
    """A client event the session cannot take; reported as an ``error`` event, session kept."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass(frozen=True)
class TurnDetectionConfig:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True


@dataclass(frozen=True)
class SessionConfig:
    """A session's settings, changed only by ``session.update``; ``None`` turn detection = manual."""

    instructions: str
    voice: str
    output_modalities: tuple[str, ...] = ("audio",)
    max_output_tokens: int | None = None
    turn_detection: TurnDetectionConfig | None = field(default_factory=TurnDetectionConfig)
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"

    @classmethod
    def from_defaults(cls, d: SessionDefaults) -> SessionConfig:
        return cls(
            instructions=d.instructions,
            voice=d.voice,
            max_output_tokens=d.max_output_tokens,
            turn_detection=TurnDetectionConfig(
                d.vad_threshold, d.prefix_padding_ms, d.silence_duration_ms
            ),
        )

    @property
    def speaks(self) -> bool:
        return "audio" in self.output_modalities


def _expect(value: Any, kind: type | tuple[type, ...], param: str) -> Any:
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise RealtimeError(f"{param} must be a number", param=param)
    if not isinstance(value, kind):
        raise RealtimeError(f"{param} has the wrong type", param=param)
    return value


def _turn_detection(raw: Any, current: TurnDetectionConfig | None) -> TurnDetectionConfig | None:
    if raw is None:
        return None
    _expect(raw, dict, "session.audio.input.turn_detection")
    kind = raw.get("type", "server_vad")
    if kind == "semantic_vad":
        raise RealtimeError(
            "turn_detection type 'semantic_vad' is not supported yet; use 'server_vad' or null",
            code="unsupported_turn_detection", param="session.audio.input.turn_detection.type",
        )
    if kind != "server_vad":
        raise RealtimeError(
            f"unknown turn_detection type {kind!r}", param="session.audio.input.turn_detection.type"
        )
    base = current or TurnDetectionConfig()
    changes: dict[str, Any] = {}
    p = "session.audio.input.turn_detection."
    if "threshold" in raw:
        threshold = float(_expect(raw["threshold"], (int, float), p + "threshold"))
        if not 0.0 < threshold < 1.0:
            raise RealtimeError("threshold must be between 0 and 1", param=p + "threshold")
        changes["threshold"] = threshold
    for key, low in (("prefix_padding_ms", 0), ("silence_duration_ms", 100)):
        if key in raw:
            value = _expect(raw[key], int, p + key)
            if value < low:
                raise RealtimeError(f"{key} must be at least {low}", param=p + key)
            changes[key] = value
    for key in ("create_response", "interrupt_response"):
        if key in raw:
            changes[key] = _expect(raw[key], bool, p + key)
    return replace(base, **changes)


def _format(raw: Any, param: str) -> str:
    if isinstance(raw, str):
        kind = raw
    else:
        kind = _expect(raw, dict, param).get("type")
    if kind == "pcm16":
        kind = "audio/pcm"
    if kind not in AUDIO_FORMATS:
        raise RealtimeError(f"unsupported audio format {kind!r} (use {sorted(AUDIO_FORMATS)})", param=param)
    if isinstance(raw, dict) and kind == "audio/pcm" and raw.get("rate", 24000) != 24000:
        raise RealtimeError("audio/pcm is 24000 Hz only", param=param + ".rate")
    return kind


def apply_session_update(config: SessionConfig, session: Any, voices: list[str]) -> SessionConfig:
    """The config after a ``session.update``; raises RealtimeError (nothing applied) when invalid."""
    _expect(session, dict, "session")
    changes: dict[str, Any] = {}
    if "instructions" in session:
        changes["instructions"] = _expect(session["instructions"], str, "session.instructions")
    modalities = session.get("output_modalities", session.get("modalities"))
    if modalities is not None:
        if not isinstance(modalities, list) or set(modalities) not in MODALITY_SETS:
            raise RealtimeError(
                "output_modalities must be ['audio'], ['text'] or both", param="session.output_modalities"
            )
        changes["output_modalities"] = tuple(modalities)
    if "max_output_tokens" in session:
        raw = session["max_output_tokens"]
        if raw == "inf" or raw is None:
            changes["max_output_tokens"] = None
        else:
            value = _expect(raw, int, "session.max_output_tokens")
            if not 1 <= value <= 4096:
                raise RealtimeError("max_output_tokens must be 1..4096 or 'inf'", param="session.max_output_tokens")
            changes["max_output_tokens"] = value
    audio = session.get("audio") or {}
    _expect(audio, dict, "session.audio")
    audio_in = audio.get("input") or {}
    audio_out = audio.get("output") or {}
    if "turn_detection" in audio_in or "turn_detection" in session:
        raw = audio_in["turn_detection"] if "turn_detection" in audio_in else session["turn_detection"]
        changes["turn_detection"] = _turn_detection(raw, config.turn_detection)
    if "format" in audio_in:
        changes["input_format"] = _format(audio_in["format"], "session.audio.input.format")
    if "format" in audio_out:
        changes["output_format"] = _format(audio_out["format"], "session.audio.output.format")
    voice = audio_out.get("voice", session.get("voice"))
    if voice is not None:
        if voice not in voices:
            raise RealtimeError(f"unknown voice {voice!r} (voices: {voices})", param="session.audio.output.voice")
        changes["voice"] = voice
    return replace(config, **changes)


def _format_object(kind: str) -> dict[str, Any]:
    return {"type": kind, "rate": 24000} if kind == "audio/pcm" else {"type": kind}


def session_object(session_id: str, config: SessionConfig, model: str) -> dict[str, Any]:
    td = config.turn_detection
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model,
        "instructions": config.instructions,
        "output_modalities": list(config.output_modalities),
        "max_output_tokens": "inf" if config.max_output_tokens is None else config.max_output_tokens,
        "audio": {
            "input": {
                "format": _format_object(config.input_format),
                "turn_detection": None if td is None else {"type": "server_vad", **td.__dict__},
            },
            "output": {"format": _format_object(config.output_format), "voice": config.voice},
        },
    }


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(message: str, code: str, param: str | None = None, event_id: str | None = None,
                kind: str = "invalid_request_error") -> dict[str, Any]:
    return event("error", error={
        "type": kind, "code": code, "message": message, "param": param, "event_id": event_id,
    })


def user_item(item_id: str, text: str | None = None) -> dict[str, Any]:
    content = {"type": "input_text", "text": text} if text is not None else {
        "type": "input_audio", "transcript": None}
    return {"id": item_id, "object": "realtime.item", "type": "message", "status": "completed",
            "role": "user", "content": [content]}


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


def ms(samples: int, rate: int) -> int:
    return math.floor(samples * 1000 / rate)
