"""The server the client tests share: the toy preset with answers long enough to talk over (40
words; the talker at 25 ms a frame generates 9.6 s of audio in about 3 s), an API key as clients
send one, and a toy that calls the first tool a client offers for each user turn (and answers the
function's result in words): frameworks offer tools with ``tool_choice: "auto"``, which the toy
otherwise never uses. Tests that offer no tools get spoken answers.

The MCP tests (``test_*_mcp.py``) use a second server of their module, ``mcp_server``: the same
pipeline, its operator listing a real MCP server (``mcp_tools``, ``harness.mcp_tools`` on loopback
in the module's event loop) in ``session.mcp_servers``, so that a session may name it."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator

import pytest

from harness.mcp_tools import ToolServer, tool_app
from harness.server import ServerProcess, run_server, serving, write_preset
from tests.api.helpers import API_KEY, toy_pipeline

PIPELINE = toy_pipeline(thinker={"options": {"answer_tokens": 40, "call_offered_tools": True}},
                        talker={"options": {"step_delay_s": 0.025}})


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("clients")
    preset = write_preset(tmp / "preset.yaml", pipeline=PIPELINE, api_key=API_KEY)
    with run_server(preset, tmp=tmp) as running:
        yield running


@pytest.fixture(scope="module")
async def mcp_tools() -> AsyncIterator[ToolServer]:
    """A real MCP server (``harness.mcp_tools``) on loopback, in the test module's event loop: its
    ``lookup`` tool answers ``token`` (tests draw a fresh one) and it records every call."""
    state = ToolServer(url="", token=f"tok-{secrets.token_hex(8)}")
    # lifespan "on": the MCP app's session manager runs in it
    async with serving(tool_app(state).streamable_http_app(), "on", 20.0) as port:
        state.url = f"http://127.0.0.1:{port}"
        yield state
        state.release.set()


@pytest.fixture(scope="module")
def mcp_server(tmp_path_factory: pytest.TempPathFactory, mcp_tools: ToolServer) -> Iterator[ServerProcess]:
    """A second server, as ``server`` but whose operator lists ``mcp_tools`` in
    ``session.mcp_servers`` (none is listed by default, so ``server`` refuses every MCP tool)."""
    tmp = tmp_path_factory.mktemp("clients-mcp")
    preset = write_preset(tmp / "preset.yaml", pipeline=PIPELINE, api_key=API_KEY,
                          session={"mcp_servers": [f"{mcp_tools.url}/"]})
    with run_server(preset, tmp=tmp) as running:
        yield running
