"""What the MCP tests share: a real MCP server (``harness.mcp_tools``: the ``mcp`` SDK's MCPServer
over streamable HTTP, its tools answering with a token drawn for each test) and a real duplex
server (uvicorn, the toy pipeline in-process), both on loopback in this process, so that tests can
lower the MCP limits (monkeypatch) and see what the model was sent.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from duplex.app_state import AppState
from duplex.app import create_app
from duplex.settings import load_preset
from duplex.tools import mcp_session
from duplex.tools.mcp_client import McpConnection
from duplex.transports.webrtc.ice import IcePolicy
from harness.mcp_tools import ToolServer, tool_app
from harness.server import serving, write_preset
from pipeline.proto import OmniRequest
from pipeline.runner import start_pipeline

TIMEOUT = 20.0
FILLER = "One moment, please."
FILLER_AFTER_MS = 400


@pytest.fixture(scope="module")
async def tool_server() -> AsyncIterator[ToolServer]:
    state = ToolServer(url="")
    # lifespan "on": the MCP app's session manager runs in it
    async with serving(tool_app(state).streamable_http_app(), "on", TIMEOUT) as port:
        state.url = f"http://127.0.0.1:{port}"
        yield state
        state.release.set()


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
    # A filler for slow calls (test_mcp_filler.py): said only by responses that speak, while
    # the caller's audio runs, so the text sessions of the other tests never hear it.
    path = write_preset(tmp_path_factory.mktemp("mcp") / "preset.yaml",
                        session={"mcp_servers": [f"{tool_server.url}/"], "call_filler_text": FILLER,
                                 "call_filler_after_ms": FILLER_AFTER_MS})
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
    async with serving(app, "off", TIMEOUT) as port:
        yield Duplex(f"http://127.0.0.1:{port}", state, requests, [])
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
