"""A real MCP server for tests and benchmarks: the ``mcp`` SDK's MCPServer, served over streamable
HTTP (``tool_app(state).streamable_http_app()``, on loopback with ``harness.server.serving``).

Its tools answer with ``state.token`` (a value drawn by the caller: no model could guess it) and
record every call they get, with the ``X-Token`` header it came with and when it came:

- ``lookup(words)``: answers the token;
- ``hang(words)``: answers only once ``state.release`` is set (a call times out first);
- ``fail(words)``: raises;
- ``/garbage``: an HTTP endpoint that answers 200 with text that is no MCP at all.

A :class:`ToolServer` lives as long as the server it describes; its lists grow with every call
(the caller clears them).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from starlette.requests import Request
from starlette.responses import PlainTextResponse


@dataclass
class ToolServer:
    """The MCP server's URL and what its tools saw; ``token`` is what ``lookup`` answers."""

    url: str
    token: str = ""
    calls: list[tuple[str, dict[str, Any], str | None]] = field(default_factory=list)  # (tool, args, X-Token)
    called_at: list[float] = field(default_factory=list)  # time.monotonic() of each call
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def seen(self, tool: str) -> list[dict[str, Any]]:
        return [args for name, args, _ in self.calls if name == tool]


def tool_app(state: ToolServer) -> MCPServer:
    """The MCP server whose tools answer from, and record into, ``state`` (module doc)."""
    server = MCPServer("duplex-test-tools")

    def note(name: str, args: dict[str, Any], ctx: Context) -> None:
        state.called_at.append(time.monotonic())
        request = ctx.request_context.request
        state.calls.append((name, args, request.headers.get("x-token") if request is not None else None))

    @server.tool(description="Looks words up.")
    def lookup(words: str, ctx: Context) -> str:
        note("lookup", {"words": words}, ctx)
        return state.token

    @server.tool(description="Takes its time.")
    async def hang(words: str, ctx: Context) -> str:
        note("hang", {"words": words}, ctx)
        await state.release.wait()
        return "too late"

    @server.tool(description="Always breaks.")
    def fail(words: str, ctx: Context) -> str:
        note("fail", {"words": words}, ctx)
        raise RuntimeError("the lookup table is on fire")

    @server.custom_route("/garbage", methods=["GET", "POST", "DELETE"])
    async def garbage(request: Request) -> PlainTextResponse:
        return PlainTextResponse("<html>this is not the MCP server you are looking for</html>")

    return server
