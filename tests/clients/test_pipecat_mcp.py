"""pipecat's ``OpenAIRealtimeLLMService``, unchanged, in a session whose tools include a remote MCP
tool that the server runs (docs/mcp.md): a real MCP server (``harness.mcp_tools``) on loopback, a
real server that lists it in ``session.mcp_servers`` (conftest.py), the toy calling the first tool
it is offered.

How the MCP tool gets into the session: pipecat sends it itself. Provider-native tools travel in a
``ToolsSchema``'s ``custom_tools`` under ``AdapterType.OPENAI``; its realtime adapter appends them,
as given, after the function tools of every ``session.update`` it sends. So a pipecat app offers
an MCP tool beside its own function tools with no client secret and no patch.

What breaks: pipecat 1.14 cannot read the MCP items of such a session. Its ``ConversationItem``
model takes only ``message``, ``function_call`` and ``function_call_output`` items, so the first
``conversation.item.added`` carrying an ``mcp_list_tools`` item (sent as soon as the session names
the server) fails to parse, and the exception ends the service's receive loop: pipecat logs it,
pushes no ``ErrorFrame``, and reads nothing more from the server, while its WebSocket stays open.
The same holds against OpenAI, whose GA types list ``mcp_list_tools``, ``mcp_call`` and the
approval items among conversation items and response outputs (the ``openai`` package's
``ConversationItem``): were the list item never sent, the ``mcp_call`` item of
``response.output_item.added`` would end the loop the same way. The first test pins that diagnosis; the other two say what a pipecat app
should get and are strict xfails until pipecat reads these items (then they pass: each was run
with pipecat's ``ConversationItem.type`` widened to any string, and passed).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from loguru import logger
from openai.types.realtime import ConversationItemAdded
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import AdapterType, ToolsSchema
from pipecat.frames import frames
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineParams, PipelineTask
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.services.llm_service import FunctionCallParams
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

from harness.mcp_tools import ToolServer
from harness.server import ServerProcess
from tests.api.helpers import API_KEY, answer_samples
from tests.clients.test_pipecat import RATE, TIMEOUT, Sink

SECRET_HEADER = "pc-mcp-header-91b4e2"
PIPECAT_CANNOT_READ_MCP_ITEMS = pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="pipecat 1.14's ConversationItem takes no mcp_list_tools/mcp_call item: its receive loop "
           "ends at the first one (see the module docstring)")


def mcp_tool(tools: ToolServer) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "tools", "server_url": f"{tools.url}/mcp",
            "allowed_tools": ["lookup"], "require_approval": "never",
            "headers": {"X-Token": SECRET_HEADER}}


@dataclass
class Pipecat:
    """A running pipeline of the service and a sink, what it saw, and what pipecat logged."""

    llm: OpenAIRealtimeLLMService
    task: PipelineTask
    context: LLMContext
    sink: Sink
    items: dict[str, Any] = field(default_factory=dict)  # each item as its last event left it
    done: set[str] = field(default_factory=set)  # the items conversation.item.done (or response.done) ended
    logged_errors: list[str] = field(default_factory=list)  # pipecat's ERROR log lines

    async def until(self, condition: Callable[[], Any], what: str) -> None:
        """Wait for ``condition``; fail at once on an error frame or an error pipecat logs (an
        exception that ended its receive loop is only logged)."""
        try:
            async with asyncio.timeout(TIMEOUT):
                while not condition():
                    assert not self.sink.errors, self.sink.errors
                    assert not self.logged_errors, self.logged_errors
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}: {self.kinds()}") from None

    def kinds(self) -> list[str]:
        return [getattr(i, "type", "?") for i in self.items.values()]

    async def listed(self) -> None:
        """Wait for the server's list of the MCP server's tools, done (as OpenAI asks, before a
        response that needs them)."""
        await self.until(lambda: any(getattr(self.items[i], "type", None) == "mcp_list_tools" for i in self.done),
                         "the mcp_list_tools item, done")


@asynccontextmanager
async def pipecat(server: ServerProcess, tools: ToolsSchema, question: str) -> AsyncIterator[Pipecat]:
    """pipecat's service, the session's ``tools`` given to it (so its first ``session.update``
    carries them), in a pipeline with a context that holds ``question`` and the context
    aggregators, as pipecat's function calling runs."""
    settings = OpenAIRealtimeLLMService.Settings(session_properties=events.SessionProperties(tools=tools))
    llm = OpenAIRealtimeLLMService(api_key=API_KEY, base_url=server.url.replace("http", "ws") + "/v1/realtime",
                                   settings=settings)
    context = LLMContext([{"role": "user", "content": question}])
    user_aggregator, assistant_aggregator = LLMContextAggregatorPair(context)
    sink = Sink()
    params = PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE)
    task = PipelineTask(Pipeline([user_aggregator, llm, sink, assistant_aggregator]), params=params)
    run = Pipecat(llm, task, context, sink)

    @llm.event_handler("on_conversation_item_created")
    async def _created(service: Any, item_id: str, item: Any) -> None:
        run.items[item_id] = item

    @llm.event_handler("on_conversation_item_updated")
    async def _updated(service: Any, item_id: str, item: Any) -> None:
        if item is not None:
            run.items[item_id] = item
            run.done.add(item_id)

    sink_id = logger.add(lambda message: run.logged_errors.append(str(message)), level="ERROR")
    runner = asyncio.get_running_loop().create_task(PipelineRunner(handle_sigint=False).run(task))
    try:
        yield run
    finally:
        await task.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        logger.remove(sink_id)


async def test_pipecat_offers_the_mcp_tool_and_its_receive_loop_ends_at_the_first_mcp_item(
    mcp_server: ServerProcess, mcp_tools: ToolServer,
) -> None:
    """The diagnosis, pinned: pipecat's session.update carries the MCP tool, the server lists it,
    and pipecat fails to parse the ``mcp_list_tools`` item, an item the openai SDK's GA types
    accept. (When pipecat learns to read it, this fails and the xfails below pass.)"""
    tools = ToolsSchema(standard_tools=[], custom_tools={AdapterType.OPENAI: [mcp_tool(mcp_tools)]})
    async with pipecat(mcp_server, tools, "What does the table say?") as run:
        try:
            async with asyncio.timeout(TIMEOUT):
                while not run.logged_errors:
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"pipecat read the session's MCP items: {run.kinds()}") from None
        [logged] = run.logged_errors
        assert "validation error for ConversationItemAdded" in logged and "mcp_list_tools" in logged, logged
        # pipecat's message ends with the raw event, which the openai SDK's types validate.
        raw = json.loads(logged.rstrip().rsplit("\n\n", 1)[1])
        event = ConversationItemAdded.model_validate(raw)
        assert event.item.type == "mcp_list_tools" and event.item.server_label == "tools"
        # Nothing reached the pipeline as an error: pipecat carries on, deaf.
        assert not run.sink.errors


@PIPECAT_CANNOT_READ_MCP_ITEMS
async def test_pipecat_session_runs_the_servers_mcp_call(mcp_server: ServerProcess, mcp_tools: ToolServer) -> None:
    """The toy calls the one tool offered, the MCP one: the server runs it on the MCP server and
    answers its output in a follow-up response of its own, whose audio pipecat receives in full."""
    mcp_tools.calls.clear()
    tools = ToolsSchema(standard_tools=[], custom_tools={AdapterType.OPENAI: [mcp_tool(mcp_tools)]})
    async with pipecat(mcp_server, tools, "What does the table say?") as run:
        await run.listed()
        await run.task.queue_frame(frames.LLMRunFrame())
        await run.until(lambda: run.sink.responses_ended >= 2, "the answer to the MCP call")
        await run.until(lambda: run.kinds().count("message") >= 2, "the answer's item")
    assert not run.sink.errors, run.sink.errors
    assert not run.logged_errors, run.logged_errors

    assert run.kinds() == ["mcp_list_tools", "message", "mcp_call", "message"], run.items
    call = next(i for i in run.items.values() if i.type == "mcp_call")
    assert call.name == "lookup" and call.output == mcp_tools.token, call
    assert mcp_tools.calls == [("lookup", json.loads(call.arguments), SECRET_HEADER)]
    # The follow-up was spoken, and pipecat received all of its audio (the call made none).
    answer = list(run.items.values())[-1]
    assert (answer.role, answer.status) == ("assistant", "completed"), answer
    assert round(run.sink.seconds() * RATE) == answer_samples(answer.content[0].transcript) > 0


@PIPECAT_CANNOT_READ_MCP_ITEMS
async def test_pipecat_function_tool_round_trips_beside_an_mcp_tool(
    mcp_server: ServerProcess, mcp_tools: ToolServer,
) -> None:
    """pipecat's own function tool and the MCP tool in one session: the toy calls the function
    (offered first), pipecat runs it and sends its result, the answer is spoken; the MCP server,
    listed, is not called."""
    mcp_tools.calls.clear()
    calls: list[dict[str, Any]] = []

    async def get_forecast(params: FunctionCallParams) -> None:
        calls.append(dict(params.arguments))
        await params.result_callback({"forecast": "sunny"})

    forecast = FunctionSchema(name="get_forecast", description="The weather forecast.",
                              properties={"words": {"type": "string"}}, required=["words"])
    tools = ToolsSchema(standard_tools=[forecast], custom_tools={AdapterType.OPENAI: [mcp_tool(mcp_tools)]})
    async with pipecat(mcp_server, tools, "What will the weather be tomorrow?") as run:
        run.llm.register_function("get_forecast", get_forecast)
        await run.listed()
        await run.task.queue_frame(frames.LLMRunFrame())
        await run.until(lambda: run.sink.responses_ended >= 2, "the answer to the function's result")
        await run.until(lambda: run.kinds().count("message") >= 2, "the answer's item")
    assert not run.sink.errors, run.sink.errors
    assert not run.logged_errors, run.logged_errors

    assert run.kinds() == ["mcp_list_tools", "message", "function_call", "function_call_output", "message"], run.items
    call = next(i for i in run.items.values() if i.type == "function_call")
    assert call.name == "get_forecast" and calls == [json.loads(call.arguments)]
    assert not mcp_tools.calls
    answer = list(run.items.values())[-1]
    assert (answer.role, answer.status) == ("assistant", "completed"), answer
    assert round(run.sink.seconds() * RATE) == answer_samples(answer.content[0].transcript) > 0
    assert [m["tool_call_id"] for m in run.context.get_messages() if m.get("role") == "tool"] == [call.call_id]
