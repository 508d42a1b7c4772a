"""``response.create``: what one response uses, resolved against the session's settings. Pure.

Every field of the event's ``response`` object is optional; what it leaves out (or sets to null,
as LiveKit does with ``instructions``) is the session's. Unlike ``session.update``, an invalid field
refuses the whole event: a response is either created as asked or not at all.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from duplex.protocol.events import RealtimeError
from duplex.protocol.fields import (
    expect,
    instructions,
    max_output_tokens,
    metadata,
    output_modalities,
    tool_choice,
    tools,
)
from duplex.protocol.session_update import audio_format, voice
from duplex.session.config import SessionConfig

CONVERSATIONS = ("auto", "none")


@dataclass(frozen=True)
class ResponseSpec:
    """One response's settings; lives as long as the response. ``input`` (raw client items) replaces
    the history as the model's input; ``out_of_band`` responses stay out of the conversation."""

    instructions: str
    voice: str
    output_modalities: tuple[str, ...]
    max_output_tokens: int | None
    output_format: str
    tools: tuple[dict[str, Any], ...]
    tool_choice: str | dict[str, Any]
    metadata: dict[str, str] | None = None
    out_of_band: bool = False
    input: tuple[dict[str, Any], ...] | None = None
    # The words the answer must be (the session's own lines: a check-in, a closing line), for
    # models that can speak given text (``params["say"]``); the instructions say so to the rest.
    say: str | None = None

    @property
    def speaks(self) -> bool:
        return "audio" in self.output_modalities

    @classmethod
    def of_session(cls, config: SessionConfig) -> ResponseSpec:
        """A response the session starts itself (end of a turn) or an empty ``response.create``."""
        return cls(config.instructions, config.voice, config.output_modalities, config.max_output_tokens,
                   config.output_format, config.tools, config.tool_choice)


def response_spec(raw: dict[str, Any], config: SessionConfig, voices: Collection[str]) -> ResponseSpec:
    """The ``response`` object of a ``response.create`` over the session's ``config``."""
    base = ResponseSpec.of_session(config)
    given = {k: v for k, v in raw.items() if v is not None}
    known = {"instructions", "metadata", "conversation", "input", "voice", "output_modalities", "modalities",
             "max_output_tokens", "max_response_output_tokens", "audio", "tools", "tool_choice", "prompt",
             "temperature", "output_audio_format"}
    unknown = sorted(set(given) - known)
    if unknown:
        raise RealtimeError(f"unknown field response.{unknown[0]}", code="unknown_parameter",
                            param=f"response.{unknown[0]}")
    out: dict[str, Any] = {}
    if "instructions" in given:
        out["instructions"] = instructions(given["instructions"], "response.instructions")
    for key in ("output_modalities", "modalities"):
        if key in given:
            out["output_modalities"] = output_modalities(given[key], f"response.{key}")
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if key in given:
            out["max_output_tokens"] = max_output_tokens(given[key], f"response.{key}")
    if "tools" in given:
        out["tools"] = tools(given["tools"], "response.tools")
    if "tool_choice" in given:
        out["tool_choice"] = tool_choice(given["tool_choice"], "response.tool_choice")
    if "metadata" in given:
        out["metadata"] = metadata(given["metadata"], "response.metadata")
    if "conversation" in given:
        if given["conversation"] not in CONVERSATIONS:
            raise RealtimeError("conversation must be 'auto' or 'none'", param="response.conversation")
        out["out_of_band"] = given["conversation"] == "none"
    if "input" in given:
        items = expect(given["input"], list, "response.input")
        for i, item in enumerate(items):
            expect(item, dict, f"response.input[{i}]")
        out["input"] = tuple(items)
    audio_out = expect(given.get("audio") or {}, dict, "response.audio").get("output") or {}
    expect(audio_out, dict, "response.audio.output")
    chosen = audio_out.get("voice", given.get("voice"))
    if chosen is not None:
        out["voice"] = voice(chosen, voices, "response.audio.output.voice")
    fmt = audio_out.get("format", given.get("output_audio_format"))
    if fmt is not None:
        out["output_format"] = audio_format(fmt, "response.audio.output.format")
    return ResponseSpec(**{**base.__dict__, **out})
