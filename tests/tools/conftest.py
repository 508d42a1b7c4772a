"""What the MCP tests share: a real MCP server (the ``mcp`` SDK's MCPServer over streamable HTTP)
and a real duplex server (uvicorn, the toy pipeline in-process), both on loopback in this process,
so that tests can lower the MCP limits (monkeypatch) and see what the model was sent.

The MCP server's tools answer with a token drawn for each test (no model could guess it) and
record every call they get, with the ``X-Token`` header it came with:

- ``lookup(words)``: answers the token;
- ``hang(words)``: answers only once the test ends (the call times out first);
- ``fail(words)``: raises;
- ``/garbage``: an HTTP endpoint that answers 200 with text that is no MCP at all.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from duplex.app_state import AppState
from duplex.serve import create_app
from duplex.settings import load_preset
from duplex.tools import mcp_session
from duplex.tools.mcp_client import McpConnection
from duplex.transports.webrtc.ice import IcePolicy
from harness.server import free_port, write_preset
from pipeline.proto import OmniRequest
from pipeline.runner import start_pipeline

TIMEOUT = 20.0


@dataclass
class ToolServer:
    """The MCP server's URL and what its tools saw; ``token`` is the current test's."""

    url: str
    token: str = ""
    calls: list[tuple[str, dict[str, Any], str | None]] = field(default_factory=list)  # (tool, args, X-Token)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def seen(self, tool: str) -> list[dict[str, Any]]:
        return [args for name, args, _ in self.calls if name == tool]


def _tool_server(state: ToolServer) -> MCPServer:
    server = MCPServer("duplex-test-tools")

    def note(name: str, args: dict[str, Any], ctx: Context) -> None:
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


async def _serve(app: Any, lifespan: str) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                           lifespan=lifespan))
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(TIMEOUT):
        while not server.started:
            await asyncio.sleep(0.02)
    return server, task, port


@pytest.fixture(scope="module")
async def tool_server() -> AsyncIterator[ToolServer]:
    state = ToolServer(url="")
    app = _tool_server(state).streamable_http_app()
    server, task, port = await _serve(app, "on")  # the MCP app's session manager runs in it
    state.url = f"http://127.0.0.1:{port}"
    yield state
    state.release.set()
    server.should_exit = True
    await task


@dataclass
class Duplex:
    """The duplex server: its ws:// base URL, state, and every request its sessions sent."""

    url: str
    state: AppState
    requests: list[OmniRequest]
    connections: list[McpConnection]


@pytest.fixture(scope="module")
async def duplex_server(tmp_path_factory: pytest.TempPathFactory,
                        tool_server: ToolServer) -> AsyncIterator[Duplex]:
    # The operator lists the one MCP server sessions may use (none by default).
    path = write_preset(tmp_path_factory.mktemp("mcp") / "preset.yaml",
                        session={"mcp_servers": [f"{tool_server.url}/"]})
    preset = load_preset(["--config", str(path)], environ={})
    app = create_app(preset, IcePolicy(hosts=("127.0.0.1",)))
    state: AppState = app.state.duplex
    pipeline = state.pipeline = await start_pipeline(preset.pipeline, mode="inproc")
    requests: list[OmniRequest] = []
    stream = pipeline.stream

    def recording(request: OmniRequest) -> Any:
        requests.append(request)
        return stream(request)

    pipeline.stream = recording  # type: ignore[method-assign]
    # No lifespan: it would load a pipeline of its own and put it in place of the recorded one.
    server, task, port = await _serve(app, "off")
    yield Duplex(f"http://127.0.0.1:{port}", state, requests, [])
    server.should_exit = True
    await task
    await state.registry.close_all()
    await pipeline.close()


@pytest.fixture
def duplex(duplex_server: Duplex, tool_server: ToolServer,
           monkeypatch: pytest.MonkeyPatch) -> Duplex:
    """The duplex server, with a fresh token on the tool server and every MCP connection recorded."""
    tool_server.token = f"tok-{secrets.token_hex(8)}"
    tool_server.calls.clear()
    duplex_server.requests.clear()
    duplex_server.connections.clear()

    class Recorded(McpConnection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            duplex_server.connections.append(self)

    monkeypatch.setattr(mcp_session, "McpConnection", Recorded)
    return duplex_server
