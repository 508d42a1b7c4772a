"""Remote MCP tools, run by the server, over the Realtime WebSocket with the openai SDK: a real MCP
server (conftest.py), the toy model (a forced call's arguments are its words: ``{"words": ...}``).

The tools are listed as an ``mcp_list_tools`` item (filtered by ``allowed_tools``); a call the
model is made to make reaches the MCP server, with the session's headers, and its output is in
the ``mcp_call`` item and in what the model is asked next (the follow-up response's input);
approval holds the call until the client approves, and a denial is answered without a call; a
server that hangs, one whose tool fails and one that is no MCP server at all each give an error
and the conversation goes on; headers never come back nor reach a log; closing the session closes
its connections.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from duplex.logs import MASK, REDACTOR
from duplex.tools import mcp_client
from harness.mcp_tools import ToolServer
from pipeline.proto import OmniRequest
from tests.api.helpers import RealtimeClient, eventually, realtime, user_text
from tests.tools.conftest import Duplex

TEXT_ONLY = {"type": "realtime", "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}}
SECRET = "hdr-secret-7f3a91c2e5"


def mcp_tool(server: ToolServer, *allowed: str, approval: Any = "never", path: str = "/mcp",
             label: str = "tools") -> dict[str, Any]:
    return {"type": "mcp", "server_label": label, "server_url": server.url + path,
            "allowed_tools": list(allowed), "require_approval": approval, "headers": {"X-Token": SECRET}}


async def next_call_works(rt: RealtimeClient, tool_server: ToolServer, response: int) -> None:
    """The conversation goes on: a forced lookup, the session's ``response``-th, is answered."""
    await rt.connection.response.create(response=force("lookup"))
    again = await rt.wait("response.done", response)
    assert again.response.output[0].output == tool_server.token


def force(name: str, label: str = "tools") -> dict[str, Any]:
    return {"tool_choice": {"type": "mcp", "server_label": label, "name": name}}


@asynccontextmanager
async def session(duplex: Duplex, *tools: dict[str, Any]) -> AsyncIterator[RealtimeClient]:
    """A text-only session whose tools are ``tools``, once their lists are done."""
    async with realtime(duplex) as rt:  # type: ignore[arg-type]
        await rt.wait("session.created")
        await rt.connection.session.update(session={**TEXT_ONLY, "tools": list(tools)})
        await rt.wait("session.updated")
        lists = [e for e in rt.events if e.type == "conversation.item.added" and e.item.type == "mcp_list_tools"]
        await rt.wait_for(lambda: len(rt.of("mcp_list_tools.completed")) + len(rt.of("mcp_list_tools.failed"))
                          >= len(lists))
        yield rt


def asked(duplex: Duplex, rt: RealtimeClient) -> list[OmniRequest]:
    """The requests this session sent the model (a session of an earlier test may still be ending)."""
    session_id = rt.of("session.created")[0].session.id
    return [r for r in duplex.requests if r.owner == session_id]


def fed(duplex: Duplex, rt: RealtimeClient, response_index: int) -> str:
    """What the model was sent for the session's ``response_index``-th request, as JSON."""
    request = asked(duplex, rt)[response_index]
    messages = [{k: v for k, v in m.items() if k != "audio"} for m in request.inputs["messages"]]
    return json.dumps({"messages": messages, "tools": request.params.get("tools")})


def outputs(done: Any) -> list[str]:
    return [o.type for o in done.response.output]


async def test_the_tools_are_listed_and_a_forced_call_is_run_and_answered(
    duplex: Duplex, tool_server: ToolServer, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with session(duplex, mcp_tool(tool_server, "lookup")) as rt:
        listed = next(e for e in rt.of("conversation.item.done") if e.item.type == "mcp_list_tools")
        assert listed.item.server_label == "tools"
        assert [t.name for t in listed.item.tools] == ["lookup"]  # allowed_tools filters hang and fail
        assert listed.item.tools[0].input_schema["properties"]["words"]["type"] == "string"
        echoed = rt.of("session.updated")[0].session.tools[0]
        assert echoed.server_label == "tools" and echoed.headers is None

        await rt.connection.conversation.item.create(item=user_text("What does the table say?"))
        await rt.connection.response.create(response=force("lookup"))
        first = await rt.wait("response.done")
        assert first.response.status == "completed", first
        assert outputs(first) == ["mcp_call"]
        call = first.response.output[0]
        assert (call.server_label, call.name, call.error) == ("tools", "lookup", None)
        assert call.output == tool_server.token
        # The MCP server got the model's arguments, with the session's header.
        assert tool_server.calls == [("lookup", json.loads(call.arguments), SECRET)]
        deltas = [e.delta for e in rt.of("response.mcp_call_arguments.delta")]
        assert "".join(deltas) == call.arguments
        assert rt.of("response.mcp_call_arguments.done")[0].arguments == call.arguments
        kinds = [t for t in rt.types() if t.startswith("response.mcp_call")]
        assert kinds[-3:] == ["response.mcp_call_arguments.done", "response.mcp_call.in_progress",
                              "response.mcp_call.completed"]

        # The server answers the output itself: a follow-up response, whose input holds it.
        answer = await rt.wait("response.done", 2)
        assert answer.response.status == "completed", answer
        assert outputs(answer) == ["message"]
        assert len(asked(duplex, rt)) == 2
        assert tool_server.token not in fed(duplex, rt, 0)
        assert tool_server.token in fed(duplex, rt, 1)
        # The model was offered the server's tool as a function (the follow-up too).
        assert [t["name"] for t in asked(duplex, rt)[0].params["tools"]] == ["lookup"]
        assert not rt.of("error")
    assert not [r for r in caplog.records if SECRET in r.getMessage()]


async def test_approval_holds_the_call_until_the_client_approves(
    duplex: Duplex, tool_server: ToolServer,
) -> None:
    async with session(duplex, mcp_tool(tool_server, "lookup", approval="always")) as rt:
        await rt.connection.conversation.item.create(item=user_text("Look it up, please."))
        await rt.connection.response.create(response=force("lookup"))
        asked = await rt.wait("response.done")
        assert outputs(asked) == ["mcp_approval_request"]
        request = asked.response.output[0]
        assert (request.server_label, request.name) == ("tools", "lookup")
        assert not tool_server.calls  # nothing is called before the client says so

        await rt.connection.conversation.item.create(item={
            "type": "mcp_approval_response", "approval_request_id": request.id, "approve": True})
        ran = await rt.wait("response.done", 2)
        assert outputs(ran) == ["mcp_call"]
        call = ran.response.output[0]
        assert call.approval_request_id == request.id
        assert call.output == tool_server.token
        assert tool_server.calls == [("lookup", json.loads(request.arguments), SECRET)]
        answer = await rt.wait("response.done", 3)
        assert outputs(answer) == ["message"] and answer.response.status == "completed"
        assert tool_server.token in fed(duplex, rt, -1)
        assert not rt.of("error")


async def test_a_denied_call_is_answered_without_calling(duplex: Duplex, tool_server: ToolServer) -> None:
    async with session(duplex, mcp_tool(tool_server, "lookup", approval={"never": {"tool_names": ["hang"]}})) as rt:
        await rt.connection.conversation.item.create(item=user_text("Look it up, please."))
        await rt.connection.response.create(response=force("lookup"))
        asked = await rt.wait("response.done")
        assert outputs(asked) == ["mcp_approval_request"]  # the filter exempts only hang
        await rt.connection.conversation.item.create(item={
            "type": "mcp_approval_response", "approval_request_id": asked.response.output[0].id,
            "approve": False, "reason": "not today"})
        answer = await rt.wait("response.done", 2)
        assert outputs(answer) == ["message"] and answer.response.status == "completed"
        assert not tool_server.calls
        assert "not today" in fed(duplex, rt, -1)  # the model is told of the denial
        # An answered request cannot be answered again.
        await rt.connection.conversation.item.create(item={
            "type": "mcp_approval_response", "approval_request_id": asked.response.output[0].id,
            "approve": True})
        error = await rt.wait("error")
        assert "answered already" in error.error.message
        assert not tool_server.calls


async def test_a_hanging_server_gives_an_error_and_the_next_turn_works(
    duplex: Duplex, tool_server: ToolServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mcp_client, "CALL_TIMEOUT_S", 0.5)
    async with session(duplex, mcp_tool(tool_server, "hang", "lookup")) as rt:
        await rt.connection.conversation.item.create(item=user_text("This will take a while."))
        await rt.connection.response.create(response=force("hang"))
        first = await rt.wait("response.done")
        assert first.response.status == "completed", first
        call = first.response.output[0]
        assert call.type == "mcp_call" and call.output is None
        assert call.error.type == "protocol_error" and "no answer within 0.5 s" in call.error.message
        assert rt.of("response.mcp_call.failed") and not rt.of("response.mcp_call.completed")
        assert tool_server.seen("hang")
        answer = await rt.wait("response.done", 2)  # the model is told of the failure, and answers
        assert outputs(answer) == ["message"] and answer.response.status == "completed"
        assert "no answer within" in fed(duplex, rt, 1)

        await next_call_works(rt, tool_server, 3)


async def test_a_failing_tool_gives_an_error_and_the_next_turn_works(
    duplex: Duplex, tool_server: ToolServer,
) -> None:
    async with session(duplex, mcp_tool(tool_server, "fail", "lookup")) as rt:
        await rt.connection.conversation.item.create(item=user_text("Try the broken one."))
        await rt.connection.response.create(response=force("fail"))
        first = await rt.wait("response.done")
        call = first.response.output[0]
        assert call.output is None and call.error.type == "tool_execution_error"
        assert rt.of("response.mcp_call.failed")
        answer = await rt.wait("response.done", 2)
        assert outputs(answer) == ["message"] and answer.response.status == "completed"
        await next_call_works(rt, tool_server, 3)


async def test_a_server_that_is_no_mcp_server_fails_its_list_and_the_session_goes_on(
    duplex: Duplex, tool_server: ToolServer,
) -> None:
    garbage = mcp_tool(tool_server, path="/garbage", label="garbage")
    async with session(duplex, garbage, mcp_tool(tool_server, "lookup")) as rt:
        failed = rt.of("mcp_list_tools.failed")
        assert len(failed) == 1 and len(rt.of("mcp_list_tools.completed")) == 1
        listed = {e.item.id: e.item for e in rt.of("conversation.item.done") if e.item.type == "mcp_list_tools"}
        assert listed[failed[0].item_id].server_label == "garbage" and listed[failed[0].item_id].tools == []
        await rt.connection.conversation.item.create(item=user_text("Hello?"))
        await rt.connection.response.create(response=force("lookup"))
        first = await rt.wait("response.done")
        assert first.response.output[0].output == tool_server.token
        assert [t["name"] for t in asked(duplex, rt)[0].params["tools"]] == ["lookup"]


async def test_closing_the_session_closes_its_connections(duplex: Duplex, tool_server: ToolServer) -> None:
    """...and lets go of its headers in the log redaction (masked while the session uses them)."""
    async with session(duplex, mcp_tool(tool_server, "lookup")) as rt:
        assert rt.of("mcp_list_tools.completed")
        assert REDACTOR(SECRET) == MASK
        [connection] = duplex.connections
        assert not connection.closed
        # A session.update that changes the server's headers reconnects; the old connection closes.
        changed = {**mcp_tool(tool_server, "lookup"), "headers": {"X-Token": SECRET + "-2"}}
        await rt.connection.session.update(session={**TEXT_ONLY, "tools": [changed]})
        await rt.wait("mcp_list_tools.completed", 2)
        await eventually(lambda: connection.closed, "the replaced connection to close")
    await eventually(lambda: all(c.closed for c in duplex.connections), "the session's connections to close")
    assert len(duplex.connections) == 2
    assert REDACTOR(SECRET) == SECRET and REDACTOR(SECRET + "-2") == SECRET + "-2"


async def test_a_server_the_operator_did_not_list_is_refused_and_never_reached(
    duplex: Duplex, tool_server: ToolServer,
) -> None:
    """The preset lists the MCP servers sessions may use (here the tool server alone): another
    address (the duplex server itself, as a client could name any internal service) and a host
    that only begins like the listed one are refused at session.update, naming the field, and
    nothing connects to them; the listed server in the same update still works."""
    port = tool_server.url.rsplit(":", 1)[1]
    elsewhere = {**mcp_tool(tool_server, "lookup", label="inside"), "server_url": duplex.url + "/mcp"}
    lookalike = {**mcp_tool(tool_server, "lookup", label="lookalike"),
                 "server_url": f"http://127.0.0.1.nip.io:{port}/mcp"}
    async with session(duplex, elsewhere, lookalike, mcp_tool(tool_server, "lookup")) as rt:
        refused = [e.error for e in rt.of("error")]
        assert [(e.code, e.param) for e in refused] == [
            ("mcp_server_not_allowed", "session.tools[0].server_url"),
            ("mcp_server_not_allowed", "session.tools[1].server_url")]
        assert [c.url for c in duplex.connections] == [tool_server.url + "/mcp"]
        assert [t.server_label for t in rt.of("session.updated")[-1].session.tools] == ["tools"]
        assert len(rt.of("mcp_list_tools.completed")) == 1
