"""Function calling in Qwen3-Omni's prompt: the tools block, past calls and results, forced calls.

Qwen3's chat template (which Qwen3-Omni shares) carries tools as text, in Hermes style:

- the system turn ends with a ``# Tools`` section that lists one JSON object per function
  (``{"type": "function", "function": {"name", "description", "parameters"}}``) between
  ``<tools>`` and ``</tools>``, then asks for calls as ``<tool_call>\\n{"name": ..., "arguments":
  ...}\\n</tool_call>`` (no system message: the section alone is the system turn);
- a call the assistant made follows its words in the same assistant turn, one ``<tool_call>``
  block per call, each on a line of its own after the words;
- results go back in a user turn, one ``<tool_response>\\n...\\n</tool_response>`` block per result,
  consecutive results in one turn.

Here these render as plain text messages (``render``) that preprocessing then passes through the
checkpoint's chat template like any other message: the tiny test checkpoint's template has no
tools support, and for the real one this text is what its template writes. The model's own calls
come back through ``call_parser.py``.

``tool_choice`` (request params, see ``forced_call``): ``"auto"`` offers the tools and lets the
model decide; ``"none"`` never reaches the pipeline with tools (the session leaves them out);
``"required"`` and ``{"type": "function", "name": X}`` force a call by prefilling the assistant
turn with the opening of one (``call_opening``): with a name, up to its arguments; with
``"required"`` and one tool, that tool's; with ``"required"`` and several tools, only up to the
name's opening quote, so the model chooses which function (it may write a name that is not among
the tools: the client sees what it wrote).

Pure functions; nothing here holds state.
"""

from __future__ import annotations

import json
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


class ToolsError(ValueError):
    """Tools or a tool choice the model cannot be given (the request's error)."""


def offered(params: dict[str, Any]) -> list[dict[str, Any]]:
    """The tools a request offers the model (none when its tool_choice is ``"none"``)."""
    tools = params.get("tools") or []
    if params.get("tool_choice") == "none":
        return []
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise ToolsError("tools must be a list of function tools")
    return list(tools)


def _name(tool: dict[str, Any]) -> str:
    # Realtime tools are flat ({"type", "name", ...}); chat-completions ones nest a "function".
    spec = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ToolsError("each tool needs a name")
    return name


def signature(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as Qwen's template lists it: ``{"type": "function", "function": {...}}``."""
    name = _name(tool)
    if isinstance(tool.get("function"), dict):
        return {"type": "function", "function": tool["function"]}
    spec = {"name": name}
    spec.update({k: tool[k] for k in ("description", "parameters") if tool.get(k) is not None})
    return {"type": "function", "function": spec}


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The ``# Tools`` section of the system turn (the template's ``tojson``: compact key order,
    ``", "`` and ``": "`` separators, non-ASCII kept)."""
    lines = "".join("\n" + json.dumps(signature(t), ensure_ascii=False) for t in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def call_text(name: str, arguments: str) -> str:
    """One past call as the assistant wrote it; ``arguments`` (JSON text) is kept verbatim."""
    return f'{OPEN}\n{{"name": "{name}", "arguments": {arguments or "{}"}}}\n{CLOSE}'


def result_text(output: str) -> str:
    return f"<tool_response>\n{output}\n</tool_response>"


def forced_call(params: dict[str, Any]) -> str | None:
    """The function a request forces the model to call: its name, ``""`` when the model chooses
    (``"required"`` with several tools), or None (no call is forced)."""
    tools, choice = offered(params), params.get("tool_choice")
    if not tools:
        return None
    if choice == "required":
        return _name(tools[0]) if len(tools) == 1 else ""
    if isinstance(choice, dict):
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        if not isinstance(name, str) or not name:
            raise ToolsError("tool_choice names no function")
        return name
    return None


def call_opening(params: dict[str, Any]) -> str | None:
    """The text that opens the assistant turn of a forced call, or None (see the module doc)."""
    name = forced_call(params)
    if name is None:
        return None
    if not name:
        return f'{OPEN}\n{{"name": "'
    return f'{OPEN}\n{{"name": "{name}", "arguments": '


def render(messages: list[dict[str, Any]], params: dict[str, Any], resumed: bool) -> list[dict[str, Any]]:
    """``messages`` (the pipeline's shape, see ``preprocess.py``) with calls, results and the
    tools block written as Qwen writes them, as plain messages (role, text, audio).

    ``resumed``: the request continues a conversation whose kept state already holds the system
    turn, so the tools section is not written again.
    """
    out: list[Any] = []
    for message in messages:
        if not isinstance(message, dict):
            out.append(message)  # preprocessing refuses it, with its own words
            continue
        calls, result = message.get("tool_calls"), message.get("tool_result")
        if calls:
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise ToolsError("messages: tool_calls must be a list of calls")
            blocks = [call_text(str(c.get("name") or ""), str(c.get("arguments") or "")) for c in calls]
            words = message.get("words")
            out.append({**message, "text": "\n".join([words, *blocks] if words else blocks)})
        elif result is not None:
            if not isinstance(result, dict):
                raise ToolsError("messages: tool_result must be an object")
            block = result_text(str(result.get("output") or ""))
            previous = out[-1] if out else None
            if isinstance(previous, dict) and previous.get("tool_result") is not None:
                previous["text"] += "\n" + block  # consecutive results share one user turn
            else:
                out.append({**message, "text": block})
        else:
            out.append(message)
    tools = offered(params)
    if tools and not resumed:
        section = tools_section(tools)
        if out and out[0].get("role") == "system":
            head = out[0].get("text")
            out[0] = {**out[0], "text": f"{head}\n\n{section}" if head else section}
        else:
            out.insert(0, {"role": "system", "text": section, "audio": None, "sample_rate": None})
    return out
