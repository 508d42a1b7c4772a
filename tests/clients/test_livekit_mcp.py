"""LiveKit Agents' OpenAI Realtime plugin, unchanged, in a session whose tools include a remote MCP
tool that the server runs (docs/mcp.md): a real MCP server (``harness.mcp_tools``) on loopback, a
real server that lists it in ``session.mcp_servers`` (conftest.py), the toy calling the first tool
it is offered.

How the MCP tool gets into the session: the plugin cannot offer one itself. It converts only its
function tools (``_convert_tools_to_oai`` skips an ``llm.ProviderTool`` and forces a raw tool's
``type`` to ``function``), and every tools update it sends (an ``AgentSession`` sends one on start,
an empty list for an agent without tools) replaces the session's tools, as OpenAI's
``session.update`` does. What it allows is OpenAI's ephemeral-key flow: the app's backend mints a
client secret (``POST /v1/realtime/client_secrets``) whose session holds the MCP tool, and the
plugin takes the ``ek_`` value as its ``api_key``. A ``RealtimeSession`` on its own sends no tools,
so the secret's MCP tool stays; the server lists it and runs the model's calls. Function tools
beside it would need an ``AgentSession``, whose tools update replaces it (the second test: the
agent's tool round-trips, the MCP server is never called).

Checked: the plugin's connection survives the MCP items and events (``mcp_list_tools`` and
``mcp_call`` items, ``mcp_list_tools.*``, ``response.mcp_call_arguments.*``,
``response.mcp_call.*``) across two spoken turns; the MCP server receives each call, with the
secret's header; the follow-up response the server starts itself reaches the plugin as a
generation whose audio it decodes in full; no ``error`` event, no error the session emits, no
exception the plugin logs while handling an event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
from livekit.plugins.openai import realtime

from harness.mcp_tools import ToolServer
from harness.server import ServerProcess
from harness.speech import speech
from tests.api.helpers import AUTH, answer_samples
from tests.clients.test_livekit import RATE, LiveKitPeer, forecast_run

SECRET_HEADER = "lk-mcp-header-5d0c7e"


def mcp_tool(tools: ToolServer) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "tools", "server_url": f"{tools.url}/mcp",
            "allowed_tools": ["lookup"], "require_approval": "never",
            "headers": {"X-Token": SECRET_HEADER}}


async def client_secret(server: ServerProcess, session: dict[str, Any]) -> str:
    """An ephemeral key minted with the API key (as an app's backend does), carrying ``session``."""
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=10) as client:
        reply = await client.post("/v1/realtime/client_secrets", json={"session": session})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["value"])


def of(events: list[dict[str, Any]], kind: str, item_type: str | None = None) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind and (item_type is None or e["item"]["type"] == item_type)]


async def test_livekit_session_runs_the_servers_mcp_calls(
    mcp_server: ServerProcess, mcp_tools: ToolServer, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="livekit")
    mcp_tools.calls.clear()
    key = await client_secret(mcp_server, {"type": "realtime", "tools": [mcp_tool(mcp_tools)]})
    model = realtime.RealtimeModel(base_url=f"{mcp_server.url}/v1", api_key=key)
    session = model.session()
    peer = LiveKitPeer(session)
    loop = asyncio.get_running_loop()
    created_at: dict[str, float] = {}  # response id -> when the plugin heard of it
    session.on("openai_server_event_received", lambda event: event["type"] == "response.created"
               and created_at.setdefault(event["response"]["id"], loop.time()))
    try:
        # The plugin's own session.update (voice, semantic_vad, transcription, tool_choice) leaves
        # the secret's MCP tool in place; the server lists its tools.
        updated = await peer.until("session.updated")
        tools = updated["session"]["tools"]
        assert [(t["type"], t["server_label"], t["headers"]) for t in tools] == [("mcp", "tools", None)]
        await peer.until("mcp_list_tools.completed")
        listed = of(peer.events, "conversation.item.done", "mcp_list_tools")
        assert [t["name"] for t in listed[0]["item"]["tools"]] == ["lookup"]

        for turn, question in enumerate(["What does the table say?", "And the next entry?"], 1):
            peer.push(speech(question, RATE, 0.3, 0.0))
            # Each spoken turn: the toy calls the MCP tool (the one tool offered), the server runs
            # it, then answers its output in a follow-up response of its own.
            called = await peer.until("response.done", 2 * turn - 1)
            assert called["response"]["status"] == "completed", called
            [call] = called["response"]["output"]
            assert (call["type"], call["name"], call["error"]) == ("mcp_call", "lookup", None), call
            assert call["output"] == mcp_tools.token
            assert mcp_tools.calls[turn - 1] == ("lookup", json.loads(call["arguments"]), SECRET_HEADER)

            answered = await peer.until("response.done", 2 * turn)
            assert answered["response"]["status"] == "completed", answered
            [answer] = answered["response"]["output"]
            assert answer["type"] == "message", answer
            # The follow-up reached the plugin as a generation of its own, its audio in full.
            heard = round(await peer.audio_of(answered["response"]["id"]) * RATE)
            assert heard == answer_samples(answer["content"][0]["transcript"]) > RATE, (turn, heard)
            if turn == 1:
                # The user waits for the answer to be played out (the toy makes audio faster than
                # real time), as a user does before asking the next question.
                await asyncio.sleep(max(0.0, created_at[answered["response"]["id"]] + heard / RATE + 0.5
                                        - loop.time()))
        assert len(mcp_tools.calls) == 2

        # The plugin read every MCP item and event on the way, and its connection held.
        kinds = {e["type"] for e in peer.events}
        assert {"mcp_list_tools.in_progress", "mcp_list_tools.completed", "response.mcp_call_arguments.delta",
                "response.mcp_call_arguments.done", "response.mcp_call.in_progress",
                "response.mcp_call.completed"} <= kinds, kinds
        assert len(of(peer.events, "conversation.item.added", "mcp_call")) == 2
        assert len(of(peer.events, "response.output_item.done", "mcp_call")) == 2
        assert len(peer.generations) == 4  # each call's response and each follow-up
    finally:
        peer.mic.cancel()
        await session.aclose()
        await model.aclose()
    assert not peer.of("error"), peer.of("error")
    assert not peer.errors, peer.errors
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records


async def test_livekit_agent_sessions_tools_replace_the_secrets_mcp_tool(
    mcp_server: ServerProcess, mcp_tools: ToolServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """Why the plugin gets no MCP tool beside its function tools: an ``AgentSession`` sends its
    agent's tools on start, which replace the session's (as OpenAI's ``session.update`` does), so
    the secret's MCP tool goes. Nothing breaks meanwhile: the agent's tool round-trips as without
    MCP, and the MCP server is never called."""
    caplog.set_level(logging.ERROR, logger="livekit")
    mcp_tools.calls.clear()
    key = await client_secret(mcp_server, {"type": "realtime", "tools": [mcp_tool(mcp_tools)]})
    run = await forecast_run(realtime.RealtimeModel(base_url=f"{mcp_server.url}/v1", api_key=key))
    result, agent, speaker, events, errors = run.result, run.agent, run.speaker, run.events, run.errors
    assert not of(events, "error"), of(events, "error")
    assert not errors, errors
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records

    # The last session.updated holds the agent's function alone; the MCP server was never called.
    last = of(events, "session.updated")[-1]["session"]["tools"]
    assert [(t["type"], t.get("name")) for t in last] == [("function", "get_forecast")], last
    assert not mcp_tools.calls
    done = [e["response"] for e in of(events, "response.done")]
    assert [r["status"] for r in done] == ["completed", "completed"], done
    call = done[0]["output"][0]
    assert call["type"] == "function_call" and agent.calls == [json.loads(call["arguments"])["words"]]
    result.expect.next_event().is_function_call(name="get_forecast")
    result.expect.next_event().is_function_call_output(output="sunny")
    result.expect.next_event().is_message(role="assistant")
    result.expect.no_more_events()
    answer = done[1]["output"][0]
    assert speaker.samples() == answer_samples(answer["content"][0]["transcript"]) > 0
