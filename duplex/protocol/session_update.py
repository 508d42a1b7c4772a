"""``session.update`` and the session object of the Realtime protocol, converted to and from a
session's :class:`~duplex.session.config.SessionConfig`. Pure functions."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from duplex.protocol.events import RealtimeError
from duplex.session.config import SessionConfig
from duplex.turns.config import TurnDetection, TurnDetectionError

AUDIO_FORMATS = {"audio/pcm", "audio/pcmu", "audio/pcma"}
MODALITY_SETS = ({"audio"}, {"text"}, {"text", "audio"})
MAX_OUTPUT_TOKENS = 4096
TURN_DETECTION = "session.audio.input.turn_detection"


def _expect(value: Any, kind: type | tuple[type, ...], param: str) -> Any:
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise RealtimeError(f"{param} must be a number", param=param)
    if not isinstance(value, kind):
        raise RealtimeError(f"{param} has the wrong type", param=param)
    return value


def _turn_detection(raw: Any, current: TurnDetection | None) -> TurnDetection | None:
    if raw is None:
        return None
    _expect(raw, dict, TURN_DETECTION)
    kind = raw.get("type", "server_vad")
    if kind == "semantic_vad":
        raise RealtimeError(
            "turn_detection type 'semantic_vad' is not supported yet; use 'server_vad' or null",
            code="unsupported_turn_detection", param=f"{TURN_DETECTION}.type",
        )
    if kind != "server_vad":
        raise RealtimeError(f"unknown turn_detection type {kind!r}", param=f"{TURN_DETECTION}.type")
    fields = {k: v for k, v in raw.items() if k in TurnDetection.__dataclass_fields__}
    try:
        return replace(current or TurnDetection(), **fields)
    except TurnDetectionError as err:
        raise RealtimeError(str(err), param=f"{TURN_DETECTION}.{err.field}") from None


def _format(raw: Any, param: str) -> str:
    kind = raw if isinstance(raw, str) else _expect(raw, dict, param).get("type")
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
        if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities) \
                or set(modalities) not in MODALITY_SETS:
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
            if not 1 <= value <= MAX_OUTPUT_TOKENS:
                raise RealtimeError(f"max_output_tokens must be 1..{MAX_OUTPUT_TOKENS} or 'inf'",
                                    param="session.max_output_tokens")
            changes["max_output_tokens"] = value
    audio = _expect(session.get("audio") or {}, dict, "session.audio")
    audio_in = _expect(audio.get("input") or {}, dict, "session.audio.input")
    audio_out = _expect(audio.get("output") or {}, dict, "session.audio.output")
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
                "turn_detection": None if td is None else {"type": "server_vad", **asdict(td)},
            },
            "output": {"format": _format_object(config.output_format), "voice": config.voice},
        },
    }
