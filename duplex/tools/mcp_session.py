"""A session's MCP servers: connections, their tools as the model is offered them, and calls.

An :class:`McpTools` belongs to one Session and lives as long as it. ``configure`` (each
``session.update``) opens a connection (:class:`~duplex.tools.mcp_client.McpConnection`) for each
MCP server the session's tools name and lists its tools, told as an ``mcp_list_tools`` item
(``conversation.item.added``, ``mcp_list_tools.in_progress``, then ``.completed`` or ``.failed``
and ``conversation.item.done``); a server kept as it was (same label, URL and headers) keeps its
connection; one dropped or changed is closed. ``close`` (the session's end) closes them all.

``offered`` turns a response's tools into what the model is offered: function tools as given,
and for each ``mcp`` tool the tools its server listed that ``allowed_tools`` lets through, as
function tools; a ``tool_choice`` naming an MCP tool becomes a function choice. A model's call of
one of those names is the server's to run (``target``), the rest are the client's. A name that two
servers (or a function tool and a server) share goes to the first; the other is not offered.
Response-level ``mcp`` tools use the session's connection of the same ``server_label`` (their own
``allowed_tools`` and ``require_approval`` apply); one the session has not listed is offered
nothing. A tool is offered once its server's list completed: clients wait for
``mcp_list_tools.completed``, as OpenAI asks them to.

Calls: a response and its follow-ups (the responses the server starts to answer a call's output)
make at most :data:`MAX_CALLS_PER_RESPONSE` MCP calls; the follow-up after the last is offered no
tools (``follow_up``), so a model that calls again and again still ends in words.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from duplex.logs import hide_secrets, unhide_secrets
from duplex.protocol.events import event, item_added, new_id
from duplex.protocol.response_create import ResponseSpec
from duplex.session.conversation import Conversation
from duplex.session.history import Item
from duplex.tools.mcp_client import McpConnection, McpFailure, McpToolInfo
from duplex.tools.mcp_items import McpCall, McpListTools
from duplex.tools.mcp_spec import allows, needs_approval

MAX_CALLS_PER_RESPONSE = 4

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class McpTarget:
    """A tool the model may call on a server, as one response offers it."""

    server_label: str
    tool: McpToolInfo
    needs_approval: bool


class _Server:
    """One connected (or connecting) server: its connection and, once listed, its tools."""

    def __init__(self, spec: dict[str, Any], connection: McpConnection) -> None:
        self.spec = spec
        self.connection = connection
        self.tools: list[McpToolInfo] | None = None  # None until listed (or when listing failed)
        self.task: asyncio.Task[None] | None = None

    def same_server(self, spec: dict[str, Any]) -> bool:
        return (self.spec["server_url"], self.spec["headers"]) == (spec["server_url"], spec["headers"])


def _closed_send(message: dict[str, Any]) -> None:
    """A closed session's send: nothing goes out."""


class McpTools:
    def __init__(self, send: Callable[[dict[str, Any]], None], conversation: Conversation,
                 log_extra: dict[str, str]) -> None:
        self._send = send
        self._conversation = conversation
        self._log_extra = log_extra
        self._servers: dict[str, _Server] = {}
        self._calls = 0  # MCP calls made by the current response and its follow-ups
        self._approved: Item | None = None  # an approved call for the next response to run
        self._closed = False
        self.log = logging.LoggerAdapter(log, log_extra)

    # --- servers ------------------------------------------------------------------------------

    def configure(self, tools: tuple[dict[str, Any], ...]) -> None:
        """The session's tools changed: connect the MCP servers they name, close the others."""
        if self._closed:
            return
        specs = {t["server_label"]: t for t in tools if t.get("type") == "mcp"}
        for label in list(self._servers):
            server = self._servers[label]
            if label not in specs or not server.same_server(specs[label]):
                self._forget(label)
            else:
                server.spec = specs[label]  # a new filter or approval rule: the connection stays
        for label, spec in specs.items():
            if label not in self._servers:
                self._connect(spec)

    def _connect(self, spec: dict[str, Any]) -> None:
        hide_secrets(*spec["headers"].values())
        label = spec["server_label"]
        connection = McpConnection(label, spec["server_url"], spec["headers"], self._log_extra)
        server = self._servers[label] = _Server(spec, connection)
        item = Item(new_id("item"), "assistant", call=McpListTools(new_id("call"), server_label=label))
        listing = item.call
        assert isinstance(listing, McpListTools)
        for message in item_added(listing.wire(item.id), self._conversation.add(item)):
            self._send(message)
        self._send(event("mcp_list_tools.in_progress", item_id=item.id))
        server.task = asyncio.get_running_loop().create_task(self._list(server, item, listing))

    async def _list(self, server: _Server, item: Item, listing: McpListTools) -> None:
        label = server.spec["server_label"]
        try:
            tools = await server.connection.open()
        except McpFailure as err:
            self.log.warning("MCP server %s: %s", label, err.error["message"])
            self._send(event("mcp_list_tools.failed", item_id=item.id))
            self._send(event("conversation.item.done", item=listing.wire(item.id)))
            return
        server.tools = tools
        listing.tools = [t.wire() for t in tools if allows(server.spec, t.name, t.annotations)]
        self.log.info("MCP server %s: %d tools listed (%d allowed)", label, len(tools), len(listing.tools))
        self._send(event("mcp_list_tools.completed", item_id=item.id))
        self._send(event("conversation.item.done", item=listing.wire(item.id)))

    def _forget(self, label: str) -> None:
        server = self._servers.pop(label)
        if server.task is not None:
            server.task.cancel()
        unhide_secrets(*server.spec["headers"].values())
        asyncio.get_running_loop().create_task(server.connection.close())

    async def close(self) -> None:
        """The session ended: close every connection (each within its close timeout)."""
        self._closed = True
        servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            if server.task is not None:
                server.task.cancel()
            unhide_secrets(*server.spec["headers"].values())
        await asyncio.gather(*(s.connection.close() for s in servers), return_exceptions=True)
        self._approved = None
        # ``send`` is the session's own method: keeping it would hold the closed session in a
        # cycle until the cyclic garbage collector runs (Session._let_go says why that matters).
        self._send = _closed_send

    # --- what the model is offered ----------------------------------------------------------

    def targets(self, tools: tuple[dict[str, Any], ...]) -> dict[str, McpTarget]:
        """The MCP tools ``tools`` (a response's) offer, by name (see the module doc)."""
        taken = {t["name"] for t in tools if t.get("type") == "function"}
        out: dict[str, McpTarget] = {}
        for spec in (t for t in tools if t.get("type") == "mcp"):
            server = self._servers.get(spec["server_label"])
            for tool in (server.tools or []) if server is not None else []:
                if tool.name in taken or not allows(spec, tool.name, tool.annotations):
                    continue
                taken.add(tool.name)
                out[tool.name] = McpTarget(spec["server_label"], tool,
                                           needs_approval(spec, tool.name, tool.annotations))
        return out

    def offered(self, tools: tuple[dict[str, Any], ...],
                choice: str | dict[str, Any]) -> tuple[list[dict[str, Any]], str | dict[str, Any]]:
        """The tools and tool choice the model is given for a response's ``tools``/``choice``."""
        functions = [t for t in tools if t.get("type") != "mcp"]
        targets = self.targets(tools)
        for name, target in targets.items():
            description = target.tool.description or ""
            functions.append({"type": "function", "name": name, "description": description,
                              "parameters": target.tool.input_schema or {"type": "object"}})
        if isinstance(choice, dict) and choice.get("type") == "mcp":
            target = targets.get(choice["name"]) if choice.get("name") else None
            if target is None or target.server_label != choice["server_label"]:
                self.log.warning("tool_choice names MCP tool %s/%s, which is not offered: auto",
                                 choice["server_label"], choice.get("name"))
                return functions, "auto"
            return functions, {"type": "function", "name": choice["name"]}
        return functions, choice

    # --- calls --------------------------------------------------------------------------------

    async def run(self, target: McpTarget | None, call: McpCall) -> tuple[str | None, dict[str, Any] | None]:
        """Run the model's ``call`` of ``target`` (None: a tool no longer offered): its (output,
        error). The model's arguments must be a JSON object; nothing is called otherwise."""
        try:
            arguments = json.loads(call.arguments or "{}")
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            return None, {"type": "protocol_error", "code": -32602,
                          "message": "the model's arguments are not a JSON object"}
        server = self._servers.get(target.server_label) if target is not None else None
        if target is None or server is None:
            return None, {"type": "protocol_error", "code": -32601,
                          "message": f"the tool {call.name} is not offered any more"}
        self._calls += 1
        outcome = await server.connection.call(target.tool.name, arguments)
        return outcome.output, outcome.error

    def follow_up(self, spec: ResponseSpec) -> ResponseSpec:
        """The response that answers a call's output: ``spec``'s settings, the model choosing
        (``auto``), or offered no tools once the calls reached :data:`MAX_CALLS_PER_RESPONSE`."""
        choice = "none" if self._calls >= MAX_CALLS_PER_RESPONSE else "auto"
        return replace(spec, tool_choice=choice, input=None)

    def response_ended(self, called: bool) -> None:
        """A response ended; one that made no MCP call ends the count of calls."""
        if not called:
            self._calls = 0

    def approve(self, item: Item) -> None:
        """``item`` (an ``mcp_call``) was approved: the next response runs it."""
        self._approved = item

    def take_approved(self) -> Item | None:
        item, self._approved = self._approved, None
        return item

    def target(self, label: str, name: str) -> McpTarget | None:
        """The tool ``name`` of the session's server ``label`` (an approved call's)."""
        server = self._servers.get(label)
        tool = next((t for t in (server.tools or []) if t.name == name), None) if server else None
        return None if tool is None else McpTarget(label, tool, False)
