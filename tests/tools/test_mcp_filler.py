"""The agent's filler while an MCP call runs slowly (issue 27: calls that don't freeze the
conversation; duplex/session/call_wait.py, ``Response.say_filler``), over the Realtime WebSocket
with the openai SDK against a real MCP server and the toy model (conftest.py).

The call runs inside the response that made it. Once it has run ``call_filler_after_ms`` of the
caller's audio, a response that said nothing before its call says the preset's filler as its own
message after the call item; the call's result is answered next, with the filler in the history
before it. A cancel while the call runs ends the call too; and an MCP call is never waited on as
if it were the client's (no filler after it was answered).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np

from harness.mcp_tools import ToolServer
from tests.api.helpers import PCM_RATE, RealtimeClient, eventually, realtime, user_text
from tests.tools.conftest import FILLER, FILLER_AFTER_MS, Duplex
from tests.tools.test_mcp_tools import asked, fed, force, mcp_tool, outputs

SPOKEN = {"type": "realtime", "output_modalities": ["audio"],
          "audio": {"input": {"turn_detection": {"type": "server_vad"}}}}


def silence(ms: int) -> np.ndarray:
    return np.zeros(PCM_RATE * ms // 1000, dtype=np.float32)


@asynccontextmanager
async def spoken_session(duplex: Duplex, tool_server: ToolServer) -> AsyncIterator[RealtimeClient]:
    """A session that speaks, under turn detection (the caller's audio is the filler's clock),
    offered the hanging tool; the tool's calls are released when it ends."""
    try:
        async with realtime(duplex) as rt:  # type: ignore[arg-type]
            await rt.wait("session.created")
            await rt.connection.session.update(session={**SPOKEN, "tools": [mcp_tool(tool_server, "hang")]})
            await rt.wait("session.updated")
            await rt.wait("mcp_list_tools.completed")
            yield rt
    finally:
        tool_server.release.set()
        tool_server.release.clear()


async def heard_after(rt: RealtimeClient, text: str) -> None:
    """Send a user text item and wait until it is done: the audio sent before it was heard."""
    await rt.connection.conversation.item.create(item=user_text(text))
    await rt.wait_for(lambda: any(getattr(e.item, "role", None) == "user" and e.item.content[0].text == text
                                  for e in rt.of("conversation.item.done")))


async def slow_call(rt: RealtimeClient) -> None:
    """The user asks, the model is made to call the hanging tool, and the call runs."""
    await rt.connection.conversation.item.create(item=user_text("Look it up, it takes a while."))
    await rt.connection.response.create(response=force("hang"))
    await rt.wait("response.mcp_call.in_progress")


def saying(duplex: Duplex, rt: RealtimeClient) -> list[int]:
    """Which of the session's requests were asked to say the filler."""
    return [i for i, r in enumerate(asked(duplex, rt)) if r.params.get("say") == FILLER]


async def test_a_slow_mcp_call_gets_the_filler_in_its_response_and_is_answered_after(
    duplex: Duplex, tool_server: ToolServer,
) -> None:
    async with spoken_session(duplex, tool_server) as rt:
        await slow_call(rt)
        await rt.append(silence(FILLER_AFTER_MS // 2))
        await eventually(lambda: tool_server.seen("hang"), "the MCP server to get the call")
        assert saying(duplex, rt) == []  # not yet
        await rt.append(silence(FILLER_AFTER_MS))
        await eventually(lambda: saying(duplex, rt) == [1], "the filler")
        assert not rt.of("response.mcp_call.completed")  # said while the call still ran

        tool_server.release.set()  # the MCP server answers
        first = await rt.wait("response.done")
        assert first.response.status == "completed", first
        assert outputs(first) == ["mcp_call", "message"]
        call, message = first.response.output
        assert call.output == "too late" and call.error is None
        assert len(rt.audio(first.response.id)) > 0  # the filler was heard in this response
        spoken = message.content[0].transcript
        assert spoken

        answer = await rt.wait("response.done", 2)
        assert answer.response.status == "completed" and outputs(answer) == ["message"], answer
        # The follow-up reads the filler, then the call's result.
        history = fed(duplex, rt, 2)
        assert "say" not in asked(duplex, rt)[2].params
        assert history.index(json.dumps(spoken)[1:-1]) < history.index("too late")

        # The call was the server's: nothing waits for the client's output, so no filler comes
        # again, however long the caller stays quiet.
        await rt.append(silence(3 * FILLER_AFTER_MS))
        await heard_after(rt, "Thanks.")
        assert len(asked(duplex, rt)) == 3 and not rt.of("error")


async def test_a_fast_call_or_a_text_answer_gets_no_filler(duplex: Duplex, tool_server: ToolServer) -> None:
    async with spoken_session(duplex, tool_server) as rt:
        await slow_call(rt)
        await eventually(lambda: tool_server.seen("hang"), "the MCP server to get the call")
        tool_server.release.set()  # answers before the caller's audio reaches the filler's time
        first = await rt.wait("response.done")
        assert outputs(first) == ["mcp_call"]
        await rt.wait("response.done", 2)
        await rt.append(silence(3 * FILLER_AFTER_MS))
        await heard_after(rt, "Thanks.")
        assert saying(duplex, rt) == [] and len(asked(duplex, rt)) == 2


async def test_cancelling_during_the_filler_ends_the_call_and_the_filler(
    duplex: Duplex, tool_server: ToolServer,
) -> None:
    async with spoken_session(duplex, tool_server) as rt:
        await slow_call(rt)
        await rt.append(silence(2 * FILLER_AFTER_MS))
        await eventually(lambda: saying(duplex, rt) == [1], "the filler")
        await rt.wait("response.output_audio.delta")
        await rt.connection.response.cancel()
        done = await rt.wait("response.done")
        assert done.response.status == "cancelled"
        call = done.response.output[0]
        assert call.type == "mcp_call" and call.output is None and "cancelled" in call.error.message
        await eventually(lambda: duplex.state.pipeline.requests_in_flight == 0, "no request in flight")
        assert len(rt.of("response.done")) == 1  # nothing answers a cancelled call
