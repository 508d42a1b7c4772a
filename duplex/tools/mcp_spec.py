"""The ``mcp`` tool of ``session.update`` and ``response.create`` (OpenAI's GA shape), checked.

``{"type": "mcp", "server_label", "server_url", "allowed_tools"?, "require_approval"?,
"headers"?, "authorization"?, "server_description"?}``: ``allowed_tools`` is a list of names or a
filter ``{"tool_names"?, "read_only"?}``; ``require_approval`` is ``"always"`` (the default, as
OpenAI's), ``"never"``, or ``{"always"?: filter, "never"?: filter}`` (a tool that neither filter
names needs approval). ``connector_id`` and ``tunnel_id`` (OpenAI's own connectors) are refused.

Which servers: only those the preset's ``session.mcp_servers`` lists (:func:`only_allowed`): a
server the operator did not list is refused (``mcp_server_not_allowed``) before anything connects
to it, so that no client makes the server reach into the network it sits in (its admin pages,
cloud metadata, other services: a request forgery). None is listed by default.

Secrets: ``headers`` and ``authorization`` are kept for the connection and never echoed
(:func:`public_tool`: ``headers`` null, no ``authorization``; OpenAI does not show them either).
Pure functions; nothing here holds state.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any
from urllib.parse import SplitResult, urlsplit

from duplex.protocol.events import RealtimeError

MAX_SERVERS = 8
"""MCP servers one session (or one response) may name: each is a connection the server holds."""
MAX_HEADERS = 32
MAX_HEADER_CHARS = 8192
MAX_URL_CHARS = 2048
LABEL = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
APPROVALS = ("always", "never")
CONNECTORS = ("connector_id", "tunnel_id")
KNOWN = {"type", "server_label", "server_url", "allowed_tools", "require_approval", "headers",
         "authorization", "server_description", "allowed_callers", "defer_loading", *CONNECTORS}


def _expect(value: Any, kind: type | tuple[type, ...], param: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise RealtimeError(f"{param} has the wrong type", param=param)
    return value


def _filter(raw: Any, param: str) -> dict[str, Any]:
    """``{"tool_names"?: [str], "read_only"?: bool}``."""
    _expect(raw, dict, param)
    unknown = sorted(set(raw) - {"tool_names", "read_only"})
    if unknown:
        raise RealtimeError(f"unknown field {param}.{unknown[0]}", code="unknown_parameter",
                            param=f"{param}.{unknown[0]}")
    out: dict[str, Any] = {}
    if raw.get("tool_names") is not None:
        names = _expect(raw["tool_names"], list, f"{param}.tool_names")
        out["tool_names"] = [_expect(n, str, f"{param}.tool_names") for n in names]
    if raw.get("read_only") is not None:
        out["read_only"] = _expect(raw["read_only"], bool, f"{param}.read_only")
    return out


def _allowed(raw: Any, param: str) -> list[str] | dict[str, Any] | None:
    if raw is None:
        return None
    if isinstance(raw, list):
        return [_expect(n, str, param) for n in raw]
    return _filter(raw, param)


def _approval(raw: Any, param: str) -> str | dict[str, Any]:
    if raw is None:
        return "always"
    if raw in APPROVALS:
        return str(raw)
    _expect(raw, dict, param)
    unknown = sorted(set(raw) - set(APPROVALS))
    if unknown:
        raise RealtimeError("require_approval is 'always', 'never' or {always?, never?} filters",
                            param=f"{param}.{unknown[0]}")
    return {k: _filter(raw[k], f"{param}.{k}") for k in APPROVALS if raw.get(k) is not None}


def _url(raw: Any, param: str) -> str:
    url = _expect(raw, str, param)
    parts = urlsplit(url)
    if len(url) > MAX_URL_CHARS or parts.scheme not in ("http", "https") or not parts.hostname:
        raise RealtimeError(f"server_url must be an http(s) URL of at most {MAX_URL_CHARS} characters",
                            param=param)
    return url


def allowed(url: str, servers: Collection[str]) -> bool:
    """Whether ``url`` is one of ``servers`` (the preset's ``mcp_servers``): the same scheme, host
    and port, and a path under the listed one (``https://mcp.example.com/`` allows all of that
    host; ``*`` allows any server)."""
    target = urlsplit(url)
    return any(entry == "*" or _under(target, urlsplit(entry)) for entry in servers)


def _under(target: SplitResult, entry: SplitResult) -> bool:
    try:
        same = (target.scheme, target.hostname, target.port) == (entry.scheme, entry.hostname, entry.port)
    except ValueError:  # a port that is no number
        return False
    base = entry.path if entry.path.endswith("/") else entry.path + "/"
    return same and (target.path == entry.path or target.path.startswith(base) or base == "/")


def only_allowed(tools: tuple[dict[str, Any], ...], servers: Collection[str],
                 param: str) -> tuple[tuple[dict[str, Any], ...], list[RealtimeError]]:
    """``tools`` without the MCP tools whose server ``servers`` does not list, and an error for
    each of those (the rest of the update applies)."""
    kept, errors = [], []
    for index, tool in enumerate(tools):
        if tool.get("type") == "mcp" and not allowed(tool["server_url"], servers):
            errors.append(RealtimeError(
                "this server may not connect to that MCP server: its operator lists the MCP "
                "servers sessions may use (the preset's session.mcp_servers)",
                code="mcp_server_not_allowed", param=f"{param}[{index}].server_url"))
        else:
            kept.append(tool)
    return tuple(kept), errors


def _headers(raw: Any, param: str) -> dict[str, str]:
    if raw is None:
        return {}
    _expect(raw, dict, param)
    if len(raw) > MAX_HEADERS:
        raise RealtimeError(f"at most {MAX_HEADERS} headers", param=param)
    for name, value in raw.items():
        # Never the value in a message: it is a secret.
        if not isinstance(value, str) or not name or len(name) + len(value) > MAX_HEADER_CHARS \
                or any(c in name + value for c in "\r\n"):
            raise RealtimeError(f"header {name[:64]!r} must be a string of one line", param=param)
    return dict(raw)


def mcp_tool(raw: dict[str, Any], param: str) -> dict[str, Any]:
    """An ``mcp`` tool, checked; what the session keeps (secrets included: see :func:`public_tool`)."""
    unknown = sorted(set(raw) - KNOWN)
    if unknown:
        raise RealtimeError(f"unknown field {param}.{unknown[0]}", code="unknown_parameter",
                            param=f"{param}.{unknown[0]}")
    for key in CONNECTORS:
        if raw.get(key) is not None:
            raise RealtimeError(f"{key} is not supported: give the MCP server's server_url",
                                code="unsupported_tool", param=f"{param}.{key}")
    label = _expect(raw.get("server_label"), str, f"{param}.server_label")
    if not LABEL.match(label):
        raise RealtimeError("server_label must be 1-64 letters, digits, '_' or '-'",
                            param=f"{param}.server_label")
    tool: dict[str, Any] = {
        "type": "mcp", "server_label": label,
        "server_url": _url(raw.get("server_url"), f"{param}.server_url"),
        "allowed_tools": _allowed(raw.get("allowed_tools"), f"{param}.allowed_tools"),
        "require_approval": _approval(raw.get("require_approval"), f"{param}.require_approval"),
        "headers": _headers(raw.get("headers"), f"{param}.headers"),
    }
    if raw.get("authorization") is not None:
        token = _expect(raw["authorization"], str, f"{param}.authorization")
        tool["headers"] = {**tool["headers"], "Authorization": f"Bearer {token}"}
    if raw.get("server_description") is not None:
        tool["server_description"] = _expect(raw["server_description"], str, f"{param}.server_description")
    return tool


def check_servers(tools: list[dict[str, Any]], param: str) -> None:
    """At most :data:`MAX_SERVERS` MCP servers, each label once."""
    labels = [t["server_label"] for t in tools if t.get("type") == "mcp"]
    if len(labels) > MAX_SERVERS:
        raise RealtimeError(f"at most {MAX_SERVERS} MCP servers", param=param)
    if len(set(labels)) != len(labels):
        raise RealtimeError("each MCP server_label may appear once", param=param)


def public_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as ``session.updated`` echoes it: an ``mcp`` tool without its secrets."""
    if tool.get("type") != "mcp":
        return tool
    return {k: v for k, v in tool.items() if k != "headers"} | {"headers": None}


def _matches(rule: dict[str, Any], name: str, annotations: dict[str, Any] | None) -> bool:
    """Whether a filter names the tool: every condition it sets holds (an empty filter: none)."""
    if not rule:
        return False
    if "tool_names" in rule and name not in rule["tool_names"]:
        return False
    return not ("read_only" in rule and bool((annotations or {}).get("readOnlyHint")) != rule["read_only"])


def allows(tool: dict[str, Any], name: str, annotations: dict[str, Any] | None) -> bool:
    """Whether the ``mcp`` tool's ``allowed_tools`` lets the model use the server's tool ``name``."""
    allowed = tool.get("allowed_tools")
    if allowed is None:
        return True
    if isinstance(allowed, list):
        return name in allowed
    return _matches(allowed, name, annotations)


def needs_approval(tool: dict[str, Any], name: str, annotations: dict[str, Any] | None) -> bool:
    rule = tool.get("require_approval", "always")
    if isinstance(rule, str):
        return rule == "always"
    return not _matches(rule.get("never") or {}, name, annotations)
