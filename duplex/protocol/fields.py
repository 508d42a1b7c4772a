"""Checks of the fields that ``session.update`` and ``response.create`` share (modalities, token
caps, tools, tool choice, metadata). Pure functions: each returns the value the session keeps, or
raises :class:`RealtimeError` naming the field (``param``)."""

from __future__ import annotations

from typing import Any

from duplex.protocol.events import RealtimeError
from duplex.tools.mcp_spec import check_servers, mcp_tool

MODALITY_SETS = ({"audio"}, {"text"}, {"text", "audio"})
MAX_OUTPUT_TOKENS = 4096
TOOL_CHOICES = ("auto", "none", "required")
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def expect(value: Any, kind: type | tuple[type, ...], param: str) -> Any:
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise RealtimeError(f"{param} must be a number", param=param)
    if not isinstance(value, kind):
        raise RealtimeError(f"{param} has the wrong type", param=param)
    return value


# Instructions go into every request of the session: a client's 16 MiB of them would be tokenized
# and prefilled (or cut) on every turn. OpenAI documents no limit; this is far above any real
# system prompt.
MAX_INSTRUCTIONS_CHARS = 100_000


def instructions(raw: Any, param: str) -> str:
    """A string of at most :data:`MAX_INSTRUCTIONS_CHARS` characters."""
    text = expect(raw, str, param)
    if len(text) > MAX_INSTRUCTIONS_CHARS:
        raise RealtimeError(f"{param} is longer than {MAX_INSTRUCTIONS_CHARS} characters", param=param)
    return text


def output_modalities(raw: Any, param: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(m, str) for m in raw) or set(raw) not in MODALITY_SETS:
        raise RealtimeError("output_modalities must be ['audio'], ['text'] or both", param=param)
    return tuple(raw)


def max_output_tokens(raw: Any, param: str) -> int | None:
    """None is "inf": no cap of the client's (the preset's own caps still apply)."""
    if raw == "inf" or raw is None:
        return None
    value = expect(raw, int, param)
    if not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise RealtimeError(f"max_output_tokens must be 1..{MAX_OUTPUT_TOKENS} or 'inf'", param=param)
    return int(value)


def tools(raw: Any, param: str) -> tuple[dict[str, Any], ...]:
    """Function tools: ``{type: "function", name, description?, parameters?}``, the client's to run;
    MCP tools: ``{type: "mcp", server_label, server_url, ...}``, the server's (``duplex.tools``)."""
    if raw is None:
        return ()
    expect(raw, list, param)
    out = []
    for i, tool in enumerate(raw):
        where = f"{param}[{i}]"
        expect(tool, dict, where)
        if tool.get("type") == "mcp":
            out.append(mcp_tool(tool, where))
            continue
        if tool.get("type", "function") != "function":
            raise RealtimeError(f"tool type {tool.get('type')!r} is not supported (function and mcp tools are)",
                                code="unsupported_tool", param=f"{where}.type")
        expect(tool.get("name"), str, f"{where}.name")
        if tool.get("description") is not None:
            expect(tool["description"], str, f"{where}.description")
        if tool.get("parameters") is not None:
            expect(tool["parameters"], dict, f"{where}.parameters")
        out.append({"type": "function", **tool})
    check_servers(out, param)
    return tuple(out)


def tool_choice(raw: Any, param: str) -> str | dict[str, Any]:
    """``auto`` | ``none`` | ``required`` | ``{type: "function", name}`` | ``{type: "mcp",
    server_label, name}`` (a tool of that MCP server)."""
    if raw is None:
        return "auto"
    if raw in TOOL_CHOICES:
        return str(raw)
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "name": raw["name"]}
    if isinstance(raw, dict) and raw.get("type") == "mcp" and isinstance(raw.get("server_label"), str) \
            and isinstance(raw.get("name"), str):
        return {"type": "mcp", "server_label": raw["server_label"], "name": raw["name"]}
    raise RealtimeError(f"tool_choice must be one of {list(TOOL_CHOICES)}, {{type: 'function', name}} "
                        "or {type: 'mcp', server_label, name}", param=param)


def metadata(raw: Any, param: str) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string keys (64 chars) to string values (512 chars)."""
    if raw is None:
        return None
    expect(raw, dict, param)
    if len(raw) > METADATA_KEYS:
        raise RealtimeError(f"metadata holds at most {METADATA_KEYS} keys", param=param)
    for key, value in raw.items():
        if len(key) > METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > METADATA_VALUE_CHARS:
            raise RealtimeError(f"metadata maps keys of up to {METADATA_KEY_CHARS} characters to strings "
                                f"of up to {METADATA_VALUE_CHARS}", param=f"{param}.{key}")
    return dict(raw)
