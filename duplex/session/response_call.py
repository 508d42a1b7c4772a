"""The call a response makes: a function call for the client to run, a call of a tool of an MCP
server (``duplex.tools``), which the server runs itself, or a call of a function the session's
transport runs itself (the SIP transport's ``transfer_call``, duplex/tools/transfer_call.py).

The model's ``function_call`` chunks (a name, then argument deltas) build the response's one call
item: a :class:`~duplex.session.history.FunctionCall` (``response.function_call_arguments.delta``),
an :class:`~duplex.tools.mcp_items.McpCall` (``response.mcp_call_arguments.delta``) or, for a tool
that needs approval, an :class:`~duplex.tools.mcp_items.McpApprovalRequest`, told whole when it is
done. A call before any text is the response's first output, in its message item's place in the
conversation.

An MCP call runs once the model's answer ended (``response.mcp_call.in_progress``, then
``.completed`` or ``.failed``: a server that hangs or fails gives the item an ``error``); its result
joins the history and ``follow_up`` is the response the session starts to answer it. A response
that runs an approved call (``McpTools.take_approved``) generates nothing: it only runs the call.

A call of the transport's function is a ``function_call`` item like a client's, but the server
answers it: once the answer's audio played out (the agent's "transferring you now" is heard first)
its arguments are done (``response.function_call_arguments.done``), the function runs, and its
output joins the conversation as a ``function_call_output`` item (``conversation.item.added`` /
``.done``) as soon as it is known, before the call item's ``response.output_item.done``. The
response waits for it (a cancelled response stops waiting; the output still joins when it comes).
Where the function asks for a reply (a transfer failed, or could not start), ``follow_up`` is a
response, offered no tools, in which the model tells the caller.

A :class:`ResponseCall` belongs to one :class:`~duplex.session.response.Response` and lives as
long as it; it sends its events through the response's host and numbers its item in the
response's outputs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from duplex.protocol.events import event, function_call_item, item_added, new_id
from duplex.protocol.items import wire_item
from duplex.protocol.response_create import ResponseSpec
from duplex.session.history import FunctionCall, Item
from duplex.tools.mcp_items import McpApprovalRequest, McpCall, result_call
from duplex.tools.mcp_session import McpTarget, McpTools

if TYPE_CHECKING:
    from duplex.session.response import ResponseHost


class ServerFunction(Protocol):
    """A function tool the session's transport runs itself (the SIP transport's transfer_call,
    duplex/tools/transfer_call.py), which the session offers its model beside the client's."""

    name: str

    def offered(self, functions: list[dict[str, Any]], choice: str | dict[str, Any],
                ) -> tuple[list[dict[str, Any]], str | dict[str, Any]]:
        """The tools a response offers the model, this one added where ``offers`` says so."""

    def offers(self, tools: list[dict[str, Any]] | tuple[dict[str, Any], ...]) -> bool:
        """Whether it is offered beside the response's ``tools`` (no client function has its name)."""

    def run(self, arguments: str, answered: Callable[[str, bool], None]) -> None:
        """Run the model's call; ``answered(output, reply)`` once, when its output is known
        (``reply``: the model should tell the caller now)."""


class OfferedTools:
    """What the model is offered for a response's tools and tool choice: its MCP servers' tools
    in place of theirs, and the transport's own function (``function``, set by the transport)
    beside them. One per session, its request builder's ``offered``; it refers to the session's
    McpTools and function, never to the session (a bound method of it would make a cycle)."""

    def __init__(self, mcp: McpTools) -> None:
        self._mcp = mcp
        self.function: ServerFunction | None = None

    def __call__(self, tools: tuple[dict[str, Any], ...], choice: str | dict[str, Any],
                 ) -> tuple[list[dict[str, Any]], str | dict[str, Any]]:
        functions, choice = self._mcp.offered(tools, choice)
        if self.function is not None:
            functions, choice = self.function.offered(functions, choice)
        return functions, choice


def transport_function(host: ResponseHost, spec: ResponseSpec) -> ServerFunction | None:
    """The session's server function, where the response offers it: its tool choice is not
    ``none`` and no client function has its name."""
    tool = host.server_function
    if tool is None or spec.tool_choice == "none" or not tool.offers(spec.tools):
        return None
    return tool


class ResponseCall:
    """One response's call item, where the model makes one (module doc)."""

    def __init__(self, host: ResponseHost, response_id: str, message: Item, spec: ResponseSpec,
                 conversation_id: str | None, outputs: dict[str, int],
                 log: logging.LoggerAdapter) -> None:
        self._host = host
        self._response_id = response_id
        self._message = message
        self._spec = spec
        self._conversation_id = conversation_id
        self._outputs = outputs  # the response's output_index of each item, shared with it
        self._log = log
        # The MCP tools the response offers, by name; an approved MCP call it runs (no model).
        self._targets = host.mcp.targets(spec.tools) if spec.tool_choice != "none" else {}
        self._function = transport_function(host, spec)
        self._server_answers = False  # the call item is the transport function's
        self._arguments_told = False  # its response.function_call_arguments.done went out
        self.approved = host.mcp.take_approved() if conversation_id is not None else None
        self.item: Item | None = None  # the call item, once the model starts one
        self.follow_up: ResponseSpec | None = None  # answers the MCP call the response ran

    @property
    def server_answers(self) -> bool:
        """Whether the call item is the server function's: the server gives its output."""
        return self._server_answers

    def on_piece(self, piece: dict[str, Any]) -> None:
        """A piece of the model's call: its name and an arguments delta."""
        if self.item is None:
            name = str(piece["name"])
            target = self._targets.get(name)
            call: FunctionCall
            if target is None:
                call = FunctionCall(new_id("call"), name)
                self._server_answers = self._function is not None and name == self._function.name
            elif target.needs_approval:
                call = McpApprovalRequest(new_id("call"), name, server_label=target.server_label)
            else:
                call = McpCall(new_id("call"), name, server_label=target.server_label)
            self._add(Item(new_id("item"), "assistant", call=call))
        assert self.item is not None and self.item.call is not None
        call, delta = self.item.call, str(piece.get("arguments") or "")
        call.arguments += delta
        index = self._outputs[self.item.id]
        if isinstance(call, McpCall):
            self._host.send(event("response.mcp_call_arguments.delta", response_id=self._response_id,
                                  item_id=self.item.id, output_index=index, delta=delta))
        elif not isinstance(call, McpApprovalRequest):  # a request is told whole, when it is done
            self._host.send(event("response.function_call_arguments.delta",
                                  response_id=self._response_id, item_id=self.item.id,
                                  output_index=index, call_id=call.call_id, delta=delta))

    def start_approved(self) -> None:
        """The response runs its approved MCP call (its arguments are the request's)."""
        item = self.approved
        assert item is not None and isinstance(item.call, McpCall)
        self._add(item)
        self._host.send(event("response.mcp_call_arguments.delta", response_id=self._response_id,
                              item_id=item.id, output_index=self._outputs[item.id],
                              delta=item.call.arguments))

    def _add(self, item: Item) -> None:
        """Announce the call item: first in the response's output, unless words came."""
        self.item = item
        self._outputs[item.id] = len(self._outputs)
        call = item.call
        if isinstance(call, McpCall | McpApprovalRequest):
            wire = wire_item(item)
        else:
            assert call is not None
            wire = function_call_item(item.id, call.call_id, call.name, "", "in_progress")
        self._host.send(event("response.output_item.added", response_id=self._response_id,
                              output_index=self._outputs[item.id], item=wire))
        if self._conversation_id is not None:
            if self._message.id not in self._outputs:
                self._host.conversation.withdraw(self._message)  # the call takes the message's place
            for message in item_added(wire, self._host.conversation.add(item)):
                self._host.send(message)

    async def run(self, until_cancelled: Callable[[Awaitable[Any]], Awaitable[None]],
                  cancelled: Callable[[], bool]) -> None:
        """Run the MCP call, if the response made one (not one waiting for approval): its
        arguments are done, it runs (given up through ``until_cancelled``), and its result joins
        the history."""
        item = self.item
        call = item.call if item is not None else None
        if item is not None and call is not None and self._server_answers and not cancelled():
            return await self._run_function(item, call, until_cancelled, cancelled)
        if item is None or not isinstance(call, McpCall) or cancelled():
            return
        send, index = self._host.send, self._outputs[item.id]
        send(event("response.mcp_call_arguments.done", response_id=self._response_id,
                   item_id=item.id, output_index=index, arguments=call.arguments))
        send(event("response.mcp_call.in_progress", item_id=item.id, output_index=index))
        target = (self._targets.get(call.name) if self.approved is None
                  else self._host.mcp.target(call.server_label, call.name))
        self._log.info("response %s: calls %s on MCP server %s", self._response_id, call.name,
                       call.server_label)
        outcome = await self._call(target, call, until_cancelled)
        if cancelled():
            call.error = {"type": "tool_execution_error", "message": "cancelled: the response was cancelled"}
            return
        call.result, call.error = outcome
        send(event("response.mcp_call.completed" if call.error is None else "response.mcp_call.failed",
                   item_id=item.id, output_index=index))
        if self._conversation_id is not None and self._spec.input is None:
            self._host.conversation.add(Item(new_id("item"), "user", call=result_call(call)))
            self.follow_up = self._host.mcp.follow_up(self._spec)

    async def _run_function(self, item: Item, call: FunctionCall,
                            until_cancelled: Callable[[Awaitable[Any]], Awaitable[None]],
                            cancelled: Callable[[], bool]) -> None:
        """Run the call of the transport's function and wait for its output (module doc)."""
        assert self._function is not None
        self._arguments_told = True
        self._host.send(event("response.function_call_arguments.done", response_id=self._response_id,
                              item_id=item.id, output_index=self._outputs[item.id],
                              call_id=call.call_id, name=call.name, arguments=call.arguments))
        outcome: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def answered(output: str, reply: bool) -> None:
            # Called by the transport as the outcome comes (a completed transfer ends the call
            # right after): the output joins the conversation now, whether or not the response
            # still waits.
            if self._conversation_id is not None:
                result = FunctionCall(call.call_id, call.name, output=output)
                self._host.conversation.create(Item(new_id("item"), "user", call=result))
            if not outcome.done():
                outcome.set_result(reply)

        self._log.info("response %s: the server runs %s", self._response_id, call.name)
        self._function.run(call.arguments, answered)
        await until_cancelled(outcome)
        if outcome.done() and outcome.result() and not cancelled() \
                and self._conversation_id is not None and self._spec.input is None:
            self.follow_up = replace(self._spec, tool_choice="none", input=None)

    async def _call(self, target: McpTarget | None, call: McpCall,
                    until_cancelled: Callable[[Awaitable[Any]], Awaitable[None]],
                    ) -> tuple[str | None, dict[str, Any] | None]:
        """The call's (output, error); given up when the response is cancelled."""
        task = asyncio.ensure_future(self._host.mcp.run(target, call))
        await until_cancelled(task)
        if not task.done() or task.cancelled():
            return None, {"type": "tool_execution_error", "message": "cancelled"}
        return task.result()

    def finish(self, status: str) -> dict[str, Any] | None:
        """The call item's closing events; its final wire form (None without a call)."""
        if self.item is None or self.item.call is None:
            return None
        item, call = self.item, self.item.call
        send, index = self._host.send, self._outputs[item.id]
        if isinstance(call, McpCall | McpApprovalRequest):
            wire = wire_item(item)
        else:
            if not self._arguments_told:
                send(event("response.function_call_arguments.done", response_id=self._response_id,
                           item_id=item.id, output_index=index, call_id=call.call_id,
                           name=call.name, arguments=call.arguments))
            wire = function_call_item(item.id, call.call_id, call.name, call.arguments,
                                      "completed" if status == "completed" else "incomplete")
        send(event("response.output_item.done", response_id=self._response_id,
                   output_index=index, item=wire))
        if self._conversation_id is not None:
            send(event("conversation.item.done", item=wire))
        return wire
