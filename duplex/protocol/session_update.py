"""``session.update`` and the session object of the Realtime protocol, converted to and from a
session's :class:`~duplex.session.config.SessionConfig`. Pure functions.

An update is applied field by field, as OpenAI does: every valid field takes effect, and each
invalid one becomes one :class:`RealtimeError` naming it (``param``) without discarding the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import asdict, replace
from typing import Any

from duplex.protocol.events import RealtimeError, format_object
from duplex.protocol.fields import (
    expect,
    instructions,
    max_output_tokens,
    output_modalities,
    tool_choice,
    tools,
)
from duplex.session.config import SessionConfig
from duplex.tools.mcp_spec import only_allowed, public_tool
from duplex.turns import end_of_turn
from duplex.turns.config import TurnDetection, TurnDetectionError

AUDIO_FORMATS = {"audio/pcm", "audio/pcmu", "audio/pcma"}
TURN_DETECTION = "session.audio.input.turn_detection"
NOISE_REDUCTION = ("near_field", "far_field")
SPEED_RANGE = (0.25, 1.5)
INCLUDE = ("item.input_audio_transcription.logprobs",)
# Keys of server_vad / semantic_vad objects the detector has no use for: accepted so that clients
# sending them are not refused. (None now: idle_timeout_ms is served, duplex/session/idle.py.)
IGNORED_TURN_KEYS: set[str] = set()


def turn_detection(raw: Any, current: TurnDetection | None,
                   param: str = TURN_DETECTION) -> TurnDetection | None:
    """server_vad or semantic_vad (TurnDetection checks types and ranges), or None: manual turns.
    semantic_vad is refused, naming the package to install, where its end-of-turn model is missing.
    """
    if raw is None:
        return None
    expect(raw, dict, param)
    unknown = sorted(set(raw) - set(TurnDetection.__dataclass_fields__) - IGNORED_TURN_KEYS)
    if unknown:
        raise RealtimeError(f"unknown turn_detection field {unknown[0]!r}", code="unknown_parameter",
                            param=f"{param}.{unknown[0]}")
    fields = {k: v for k, v in raw.items() if k not in IGNORED_TURN_KEYS}
    try:
        td = replace(current or TurnDetection(), **{"type": "server_vad", **fields})
    except TurnDetectionError as err:
        raise RealtimeError(str(err), param=f"{param}.{err.field}") from None
    try:
        end_of_turn.require_model(td.type)
    except end_of_turn.ModelNotInstalled as err:
        raise RealtimeError(str(err), code="model_not_installed", param=param) from None
    return td


def audio_format(raw: Any, param: str) -> str:
    kind = raw if isinstance(raw, str) else expect(raw, dict, param).get("type")
    if kind == "pcm16":
        kind = "audio/pcm"
    if kind not in AUDIO_FORMATS:
        raise RealtimeError(f"unsupported audio format {kind!r} (use {sorted(AUDIO_FORMATS)})", param=param)
    if isinstance(raw, dict) and kind == "audio/pcm" and raw.get("rate", 24000) != 24000:
        raise RealtimeError("audio/pcm is 24000 Hz only", param=param + ".rate")
    return kind


def voice(raw: Any, voices: Collection[str], param: str) -> str:
    if raw not in voices:
        raise RealtimeError(f"unknown voice {raw!r} (voices: {sorted(voices)})", param=param)
    return str(raw)


def _transcription(raw: Any, param: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    expect(raw, dict, param)
    for key in ("model", "language", "prompt"):
        if raw.get(key) is not None:
            expect(raw[key], str, f"{param}.{key}")
    return dict(raw)


def _noise_reduction(raw: Any, param: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    expect(raw, dict, param)
    if raw.get("type") not in NOISE_REDUCTION:
        raise RealtimeError(f"noise_reduction.type must be one of {list(NOISE_REDUCTION)}",
                            param=f"{param}.type")
    return dict(raw)


def _echo_cancellation(raw: Any, param: str) -> bool:
    """duplex's own field: whether the server cancels the agent's echo (duplex/media/front_end.py)."""
    if not isinstance(raw, bool):
        raise RealtimeError(f"{param} must be true or false", param=param)
    return raw


def _speed(raw: Any, param: str) -> float:
    value = float(expect(raw, (int, float), param))
    if not SPEED_RANGE[0] <= value <= SPEED_RANGE[1]:
        raise RealtimeError(f"speed must be between {SPEED_RANGE[0]} and {SPEED_RANGE[1]}", param=param)
    return value


def _tracing(raw: Any, param: str) -> str | dict[str, Any] | None:
    if raw is None or raw == "auto":
        return raw
    expect(raw, dict, param)
    for key in ("workflow_name", "group_id"):
        if raw.get(key) is not None:
            expect(raw[key], str, f"{param}.{key}")
    if raw.get("metadata") is not None:
        expect(raw["metadata"], dict, f"{param}.metadata")
    return dict(raw)


def _include(raw: Any, param: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or any(v not in INCLUDE for v in raw):
        raise RealtimeError(f"include may list only {list(INCLUDE)}", param=param)
    return tuple(raw)


def _truncation(raw: Any, param: str) -> str | dict[str, Any]:
    if raw in ("auto", "disabled"):
        return raw
    expect(raw, dict, param)
    ratio = raw.get("retention_ratio")
    if raw.get("type") != "retention_ratio" or isinstance(ratio, bool) \
            or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise RealtimeError("truncation must be 'auto', 'disabled' or {type: 'retention_ratio', "
                            "retention_ratio: 0..1}", param=param)
    return dict(raw)


def _prompt(raw: Any, param: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    expect(raw, dict, param)
    expect(raw.get("id"), str, f"{param}.id")
    if raw.get("variables") is not None:
        expect(raw["variables"], dict, f"{param}.variables")
    return dict(raw)


def _session_type(raw: Any, param: str) -> None:
    if raw != "realtime":
        raise RealtimeError("only 'realtime' sessions are served (not transcription sessions)", param=param)


Parse = Callable[[Any, str], Any]

# Each field: the SessionConfig attribute it sets ("" for fields accepted and not kept) and its check.
SESSION_FIELDS: dict[str, tuple[str, Parse]] = {
    "type": ("", _session_type),
    "model": ("", lambda raw, param: expect(raw, str, param)),  # the preset decides the model
    "instructions": ("instructions", instructions),
    "output_modalities": ("output_modalities", output_modalities),
    "modalities": ("output_modalities", output_modalities),
    "max_output_tokens": ("max_output_tokens", max_output_tokens),
    "max_response_output_tokens": ("max_output_tokens", max_output_tokens),
    "tools": ("tools", tools),
    "tool_choice": ("tool_choice", tool_choice),
    "tracing": ("tracing", _tracing),
    "include": ("include", _include),
    "truncation": ("truncation", _truncation),
    "prompt": ("prompt", _prompt),
}
# The beta API's flat names, which older clients still send, for the GA audio fields.
BETA_AUDIO_FIELDS = {"input_audio_format": ("input", "format"), "output_audio_format": ("output", "format"),
                     "turn_detection": ("input", "turn_detection"),
                     "input_audio_transcription": ("input", "transcription"),
                     "input_audio_noise_reduction": ("input", "noise_reduction"),
                     "voice": ("output", "voice"), "speed": ("output", "speed")}


def _audio_fields(session: dict[str, Any], errors: list[RealtimeError]) -> dict[str, dict[str, Any]]:
    """``session.audio``'s input and output fields, with the beta names where GA ones are absent."""
    sections: dict[str, dict[str, Any]] = {"input": {}, "output": {}}
    try:
        for key, value in expect(session.get("audio") or {}, dict, "session.audio").items():
            if key not in sections:
                errors.append(RealtimeError(f"unknown field session.audio.{key}", code="unknown_parameter",
                                            param=f"session.audio.{key}"))
            elif value is not None:
                sections[key] = dict(expect(value, dict, f"session.audio.{key}"))
    except RealtimeError as err:
        errors.append(err)
    for beta, (part, key) in BETA_AUDIO_FIELDS.items():
        if beta in session:
            sections[part].setdefault(key, session[beta])
    return sections


def apply_session_update(config: SessionConfig, session: dict[str, Any], voices: Collection[str],
                         mcp_servers: Collection[str] = ()) -> tuple[SessionConfig, list[RealtimeError]]:
    """The config after a ``session.update`` (every valid field applied), and one error per invalid
    field. ``voices``: the names a client may choose (the preset's voices and its voice_map);
    ``mcp_servers``: the MCP servers its tools may name (the preset's ``session.mcp_servers``;
    an MCP tool naming another is dropped with an error, :func:`~duplex.tools.mcp_spec.only_allowed`)."""
    errors: list[RealtimeError] = []
    changes: dict[str, Any] = {}
    audio = _audio_fields(session, errors)
    top = {k: v for k, v in session.items() if k != "audio" and k not in BETA_AUDIO_FIELDS}
    audio_in: dict[str, tuple[str, Parse]] = {
        "format": ("input_format", audio_format),
        "turn_detection": ("turn_detection", lambda raw, p: turn_detection(raw, config.turn_detection, p)),
        "transcription": ("transcription", _transcription),
        "noise_reduction": ("noise_reduction", _noise_reduction),
        "echo_cancellation": ("echo_cancellation", _echo_cancellation),
    }
    audio_out: dict[str, tuple[str, Parse]] = {
        "format": ("output_format", audio_format),
        "voice": ("voice", lambda raw, p: voice(raw, voices, p)),
        "speed": ("speed", _speed),
    }
    for prefix, fields, table in (("session", top, SESSION_FIELDS),
                                  ("session.audio.input", audio["input"], audio_in),
                                  ("session.audio.output", audio["output"], audio_out)):
        for key, raw in fields.items():
            param = f"{prefix}.{key}"
            if key not in table:
                errors.append(RealtimeError(f"unknown field {param}", code="unknown_parameter", param=param))
                continue
            name, parse = table[key]
            try:
                value = parse(raw, param)
            except RealtimeError as err:
                errors.append(err)
                continue
            if name:
                changes[name] = value
    if "tools" in changes:
        changes["tools"], refused = only_allowed(changes["tools"], mcp_servers, "session.tools")
        errors += refused
    return replace(config, **changes), errors


def turn_detection_object(td: TurnDetection | None) -> dict[str, Any] | None:
    """GA shape: server_vad with its numbers, semantic_vad with its eagerness."""
    if td is None:
        return None
    fields = {"type": "server_vad", **asdict(td)}
    semantic = ("type", "eagerness", "create_response", "interrupt_response")
    if fields["type"] == "semantic_vad":
        # OpenAI's semantic_vad has no idle timeout; ours does, and says so only where it is set.
        extra = ("idle_timeout_ms",) if td.idle_timeout_ms is not None else ()
        return {k: v for k, v in fields.items() if k in semantic + extra}
    return {k: v for k, v in fields.items() if k != "eagerness"}


def session_object(session_id: str, config: SessionConfig, model: str) -> dict[str, Any]:
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model,
        "instructions": config.instructions,
        "output_modalities": list(config.output_modalities),
        "max_output_tokens": "inf" if config.max_output_tokens is None else config.max_output_tokens,
        "tools": [public_tool(t) for t in config.tools],  # MCP headers are never echoed
        "tool_choice": config.tool_choice,
        "tracing": config.tracing,
        "truncation": config.truncation,
        "prompt": config.prompt,
        "include": list(config.include),
        "audio": {
            "input": {
                "format": format_object(config.input_format),
                "transcription": config.transcription,
                "noise_reduction": config.noise_reduction,
                "echo_cancellation": config.echo_cancellation,  # duplex's own
                "turn_detection": turn_detection_object(config.turn_detection),
            },
            "output": {"format": format_object(config.output_format), "voice": config.voice,
                       "speed": config.speed},
        },
    }
