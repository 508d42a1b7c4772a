"""One connection to one remote MCP server (streamable HTTP), through the official ``mcp`` SDK.

An :class:`McpConnection` belongs to one session's :class:`~duplex.tools.mcp_session.McpTools`
and lives from the ``session.update`` that named its server until an update drops or changes the
server, or the session closes (``close``: the SDK's DELETE ends the server's session, then the
HTTP client closes). The SDK's client is an anyio context whose task group must be entered and
left by one task: the connection's own task (``_serve``) enters it, lists the tools and then
holds it open until ``close``; calls from the session's responses go through it meanwhile.

Limits (what a hanging, failing or garbage-returning server can cost): connecting and listing
take at most :data:`CONNECT_TIMEOUT_S`, a call :data:`CALL_TIMEOUT_S`, closing
:data:`CLOSE_TIMEOUT_S`; a server lists at most :data:`MAX_TOOLS` tools (pages beyond
:data:`MAX_LIST_PAGES` are not asked for), a tool whose schema is longer than
:data:`MAX_SCHEMA_CHARS` is left out, and a call's output is cut at :data:`MAX_OUTPUT_CHARS`.
Every failure becomes an :class:`McpFailure` (or a call's ``error``), never an exception that
reaches the session. Header values (tokens) are never logged.

The SDK is imported by the first connection, not with the server: it takes ~1 s to import, which
every server start paid whether or not a session ever named an MCP server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx2

if TYPE_CHECKING:
    from mcp import Client

CONNECT_TIMEOUT_S = 10.0
CALL_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 3.0
MAX_TOOLS = 64
MAX_LIST_PAGES = 8
MAX_SCHEMA_CHARS = 16_000
MAX_DESCRIPTION_CHARS = 2_000
MAX_OUTPUT_CHARS = 20_000
TRUNCATED = " …(output truncated)"
TIMEOUT_CODE = -32001  # the JSON-RPC code MCP SDKs use for a request that timed out

log = logging.getLogger(__name__)


class McpFailure(Exception):
    """A server that could not be reached or listed; ``error`` is the item's error object."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error["message"])
        self.error = error


@dataclass(frozen=True)
class McpToolInfo:
    """A tool the server listed: as ``mcp_list_tools`` shows it and the model is offered it."""

    name: str
    description: str | None
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None

    def wire(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "input_schema": self.input_schema,
                "annotations": self.annotations}


@dataclass(frozen=True)
class McpOutcome:
    """A call's result: its ``output`` text, or an ``error`` object (OpenAI's mcp_call error shapes:
    ``protocol_error`` {code, message}, ``tool_execution_error`` {message}, ``http_error`` {code,
    message})."""

    output: str | None = None
    error: dict[str, Any] | None = None


def _error(err: BaseException, doing: str, timeout_s: float) -> dict[str, Any]:
    from mcp.shared.exceptions import MCPError

    if isinstance(err, TimeoutError) or isinstance(err, MCPError) and err.code == TIMEOUT_CODE:
        return {"type": "protocol_error", "code": TIMEOUT_CODE,
                "message": f"{doing}: no answer within {timeout_s:g} s"}
    if isinstance(err, MCPError):
        return {"type": "protocol_error", "code": err.code, "message": f"{doing}: {err.message}"}
    if isinstance(err, httpx2.HTTPStatusError):
        return {"type": "http_error", "code": err.response.status_code, "message": f"{doing}: HTTP error"}
    if isinstance(err, BaseExceptionGroup) and err.exceptions:
        return _error(err.exceptions[0], doing, timeout_s)
    return {"type": "protocol_error", "code": -32603, "message": f"{doing}: {type(err).__name__}"}


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + TRUNCATED


def _text(result: Any) -> str:
    """A call result's content as text: its text blocks, else its structured content as JSON, else
    each block's JSON."""
    texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
    if texts:
        return "\n".join(texts)
    if result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(block.model_dump_json(exclude_none=True) for block in result.content)


class McpConnection:
    """One session's connection to the server at ``url`` (see the module doc); ``label`` names it
    in logs, never ``headers``."""

    def __init__(self, label: str, url: str, headers: dict[str, str], log_extra: dict[str, str]) -> None:
        self.label = label
        self.url = url
        self._headers = headers
        self._client: Client | None = None
        self._ready: asyncio.Future[list[McpToolInfo]] = asyncio.get_running_loop().create_future()
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.log = logging.LoggerAdapter(log, log_extra)

    async def open(self) -> list[McpToolInfo]:
        """Connect and list the tools, within :data:`CONNECT_TIMEOUT_S`; :class:`McpFailure` if not."""
        self._task = asyncio.get_running_loop().create_task(self._serve())
        try:
            return await asyncio.wait_for(asyncio.shield(self._ready), CONNECT_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - every failure is the item's error
            await self.close()
            raise McpFailure(_error(err, "listing tools", CONNECT_TIMEOUT_S)) from None

    async def _serve(self) -> None:
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        try:
            timeout = httpx2.Timeout(CONNECT_TIMEOUT_S, read=CALL_TIMEOUT_S + 1)
            async with contextlib.AsyncExitStack() as stack:
                http = await stack.enter_async_context(create_mcp_http_client(self._headers, timeout))
                transport = streamable_http_client(self.url, http_client=http)
                client = Client(transport, read_timeout_seconds=CONNECT_TIMEOUT_S, cache=None)
                await stack.enter_async_context(client)
                tools = await self._list(client)
                self._client = client
                if not self._ready.done():
                    self._ready.set_result(tools)
                await self._closing.wait()
        except BaseException as err:  # the task's end, however it comes, tells open()
            if not self._ready.done():
                self._ready.set_exception(err if isinstance(err, Exception) else asyncio.CancelledError())
            if not isinstance(err, (Exception, asyncio.CancelledError)):
                raise
        finally:
            self._client = None

    async def _list(self, client: Client) -> list[McpToolInfo]:
        tools: list[McpToolInfo] = []
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            for tool in page.tools:
                schema = tool.input_schema if isinstance(tool.input_schema, dict) else {}
                if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
                    self.log.warning("MCP server %s: tool %r left out (its schema is over %d characters)",
                                     self.label, tool.name[:64], MAX_SCHEMA_CHARS)
                    continue
                notes = tool.annotations.model_dump(exclude_none=True) if tool.annotations else None
                description = _cut(tool.description, MAX_DESCRIPTION_CHARS) if tool.description else None
                tools.append(McpToolInfo(tool.name, description, schema, notes))
            cursor = page.next_cursor
            if not cursor or len(tools) >= MAX_TOOLS:
                break
        return tools[:MAX_TOOLS]

    async def call(self, name: str, arguments: dict[str, Any]) -> McpOutcome:
        """Call the tool ``name``: its output, or an error (see :class:`McpOutcome`); at most
        :data:`CALL_TIMEOUT_S`. Cancelling the caller abandons the call."""
        client = self._client
        if client is None:
            return McpOutcome(error={"type": "protocol_error", "code": -32000,
                                     "message": f"the MCP server {self.label} is not connected"})
        try:
            result = await asyncio.wait_for(
                client.call_tool(name, arguments, read_timeout_seconds=CALL_TIMEOUT_S), CALL_TIMEOUT_S + 0.5)
        except Exception as err:  # noqa: BLE001 - a failed call is the item's error, the session goes on
            error = _error(err, f"calling {name}", CALL_TIMEOUT_S)
            self.log.warning("MCP server %s: %s", self.label, error["message"])
            return McpOutcome(error=error)
        text = _cut(_text(result), MAX_OUTPUT_CHARS)
        if result.is_error:
            return McpOutcome(error={"type": "tool_execution_error", "message": text})
        return McpOutcome(output=text)

    @property
    def closed(self) -> bool:
        """Closed, and its task (the SDK's client and HTTP connections) has ended."""
        return self._closing.is_set() and (self._task is None or self._task.done())

    async def close(self) -> None:
        """End the connection (idempotent): the SDK's context exits within
        :data:`CLOSE_TIMEOUT_S`, else its task is cancelled."""
        self._closing.set()
        task = self._task
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a server that does not answer the DELETE
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
