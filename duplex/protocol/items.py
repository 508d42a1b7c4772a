"""A history item as the Realtime protocol shows it (``conversation.item.*`` events, retrieve);
MCP items show themselves (``duplex.tools.mcp_items``)."""

from __future__ import annotations

from typing import Any

from duplex.protocol.events import (
    assistant_item,
    function_call_item,
    function_call_output_item,
    message_item,
)
from duplex.session.history import Item
from duplex.tools.mcp_items import McpItem


def wire_item(item: Item) -> dict[str, Any]:
    """A completed item (an answer cut short is ``incomplete``)."""
    if isinstance(item.call, McpItem):  # type: ignore[misc, arg-type]
        return item.call.wire(item.id)
    if item.call is not None:
        call = item.call
        if call.output is not None:
            return function_call_output_item(item.id, call.call_id, call.output)
        return function_call_item(item.id, call.call_id, call.name, call.arguments, "completed")
    if item.speaks:
        return assistant_item(item.id, True, item.transcript,
                              "incomplete" if item.truncated_at_ms is not None else "completed")
    wire = message_item(item.id, item.role, item.transcript or None, audio=item.audio is not None)
    if item.images:
        # The server keeps the decoded pixels, not the data URL: the parts say an image was there.
        said = wire["content"] if item.audio is not None or item.transcript else []
        wire["content"] = [*said, *({"type": "input_image", "detail": "auto"} for _ in item.images)]
    return wire
