"""The MCP items of a conversation, as the history keeps them and the Realtime protocol shows them.

Each rides in a history :class:`~duplex.session.history.Item`'s ``call`` slot (as function calls
do), so that the history says what the model sees of it through ``as_text`` / ``fields``:

- ``mcp_list_tools`` (:class:`McpListTools`): the tools a server listed; the model sees nothing
  of it (it is offered the tools instead);
- ``mcp_call`` (:class:`McpCall`): the model's call, seen as its call; the call's result (output,
  or its error) follows it in the history as an item of its own, unannounced (:func:`result_call`),
  seen as the call's result;
- ``mcp_approval_request`` (:class:`McpApprovalRequest`) and ``mcp_approval_response``
  (:class:`McpApprovalResponse`): an approved request is seen as nothing (the ``mcp_call`` that
  follows is the call); a denied one as the call, answered by the denial.

Items live as long as the history keeps them (its owner is the session).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from duplex.session.history import FunctionCall


@dataclass
class McpListTools(FunctionCall):
    server_label: str = ""
    tools: list[dict[str, Any]] = field(default_factory=list)

    @property
    def as_text(self) -> str | None:  # type: ignore[override]
        return None

    @property
    def fields(self) -> dict[str, Any]:
        return {}

    def wire(self, item_id: str) -> dict[str, Any]:
        return {"id": item_id, "object": "realtime.item", "type": "mcp_list_tools",
                "server_label": self.server_label, "tools": self.tools}


@dataclass
class McpCall(FunctionCall):
    """``call_id`` is the id the model's call has in the pipeline's messages; ``result`` the
    server's output (``output`` stays None: this item is the call, see the module doc)."""

    server_label: str = ""
    result: str | None = None
    error: dict[str, Any] | None = None
    approval_request_id: str | None = None

    def wire(self, item_id: str, status: str | None = None) -> dict[str, Any]:
        item = {"id": item_id, "object": "realtime.item", "type": "mcp_call",
                "server_label": self.server_label, "name": self.name, "arguments": self.arguments,
                "approval_request_id": self.approval_request_id, "output": self.result,
                "error": self.error}
        return item if status is None else {**item, "status": status}


@dataclass
class McpApprovalRequest(FunctionCall):
    server_label: str = ""
    approved: bool | None = None  # the client's answer, once it came

    @property
    def as_text(self) -> str | None:  # type: ignore[override]
        return super().as_text if self.approved is False else None

    @property
    def fields(self) -> dict[str, Any]:
        return super().fields if self.approved is False else {}

    def wire(self, item_id: str) -> dict[str, Any]:
        return {"id": item_id, "object": "realtime.item", "type": "mcp_approval_request",
                "server_label": self.server_label, "name": self.name, "arguments": self.arguments}


@dataclass
class McpApprovalResponse(FunctionCall):
    """``call_id``: the request's (so a denial answers its call); ``approval_request_id``: the
    request item's id."""

    approval_request_id: str = ""
    approve: bool = False
    reason: str | None = None

    def __post_init__(self) -> None:
        if not self.approve:
            because = f": {self.reason}" if self.reason else ""
            self.output = f"The user did not approve this call{because}"

    @property
    def as_text(self) -> str | None:  # type: ignore[override]
        return super().as_text if not self.approve else None

    @property
    def fields(self) -> dict[str, Any]:
        return super().fields if not self.approve else {}

    def wire(self, item_id: str) -> dict[str, Any]:
        return {"id": item_id, "object": "realtime.item", "type": "mcp_approval_response",
                "approval_request_id": self.approval_request_id, "approve": self.approve,
                "reason": self.reason}


def result_call(call: McpCall) -> FunctionCall:
    """What the model is told of the call's result: its output, or its error."""
    if call.result is not None:
        return FunctionCall(call.call_id, call.name, output=call.result)
    message = (call.error or {}).get("message", "the call failed")
    return FunctionCall(call.call_id, call.name, output=f"Error: {message}")


McpItem = McpListTools | McpCall | McpApprovalRequest | McpApprovalResponse
