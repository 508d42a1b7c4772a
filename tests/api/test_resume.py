"""Sessions that survive a dropped connection (docs/resume.md): a Realtime WebSocket client whose
socket breaks resumes its session with the token of its ``session.created``. A real server (toy
preset with long answers, an API key, one session at most, a grace period of a few seconds), raw
``websockets`` clients that can drop their TCP connection without a close frame, and the
``openai`` SDK resuming through ``extra_query``. Runs in the loopback-only namespace."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets
from openai import AsyncOpenAI

from duplex.protocol.wire_audio import wire_seconds
from harness.server import ServerProcess, run_server, write_preset
from tests.api.helpers import (
    ANSWER_WORDS,
    API_KEY,
    AUTH,
    FRAMES_PER_WORD,
    PIPELINE,
    SHORT_ANSWER,
    TIMEOUT,
    eventually,
    metric,
    pipeline_idle,
    user_text,
)

GRACE_S = 4.0
MS_PER_WORD = FRAMES_PER_WORD * 80  # the toy's 80 ms codec frames
WS = {"transport": "websocket"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("resume")
    preset = write_preset(tmp / "preset.yaml", pipeline=PIPELINE, api_key=API_KEY, max_sessions=1,
                          session={"resume_grace_s": GRACE_S})
    with run_server(preset, tmp=tmp) as running:
        yield running


class Client:
    """A raw WebSocket client that keeps every server event; ``drop`` breaks its TCP connection
    with no close frame, as a lost network does."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def open(cls, server: ServerProcess, key: str = API_KEY, **query: str) -> Client:
        url = server.url.replace("http", "ws") + "/v1/realtime?model=gpt-realtime"
        url += "".join(f"&{k}={v}" for k, v in query.items())
        ws = await websockets.connect(url, additional_headers={"Authorization": f"Bearer {key}"},
                                      max_size=None)
        return cls(ws)

    async def send(self, kind: str, **fields: Any) -> None:
        await self.ws.send(json.dumps({"type": kind, **fields}))

    async def until(self, kind: str, count: int = 1) -> dict[str, Any]:
        async with asyncio.timeout(TIMEOUT):
            while len(self.of(kind)) < count:
                self.events.append(json.loads(await self.ws.recv()))
        return self.of(kind)[count - 1]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def drop(self) -> None:
        self.ws.transport.abort()

    async def refused(self) -> dict[str, Any]:
        """The error event of a refused resume; the socket is then closed with 1008."""
        error = await self.until("error")
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await self.ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        return error["error"]


def waiting(server: ServerProcess) -> float:
    return metric(server, "duplex_sessions_awaiting_resume", WS)


def live(server: ServerProcess) -> float:
    return metric(server, "duplex_sessions_active", WS)


async def dropped(server: ServerProcess, client: Client) -> None:
    """Drop ``client`` and wait until the server holds its session for a resume."""
    client.drop()
    await eventually(lambda: waiting(server) == 1 and live(server) == 1, "the session to wait")


async def released(server: ServerProcess) -> None:
    await eventually(lambda: live(server) == 0 and waiting(server) == 0 and pipeline_idle(server),
                     "the session's release")


async def test_a_dropped_session_resumes_its_conversation_config_and_truncated_answer(
        server: ServerProcess) -> None:
    first = await Client.open(server)
    created = (await first.until("session.created"))["session"]
    token = created["resume_token"]
    await first.send("session.update", session={
        "type": "realtime", "instructions": "Remember the pineapple.", "max_output_tokens": "inf",
        "audio": {"input": {"turn_detection": None}, "output": {"voice": "marin"}}})
    await first.until("session.updated")
    await first.send("conversation.item.create", item=user_text("First question."))
    await first.send("response.create", response={"max_output_tokens": SHORT_ANSWER})
    answered = (await first.until("response.done"))["response"]
    await first.send("conversation.item.create", item=user_text("Tell me a long story."))
    await first.send("response.create")
    cut = (await first.until("response.created", 2))["response"]["id"]
    await first.until("response.output_audio.delta", len(first.of("response.output_audio.delta")) + 5)
    # Whole milliseconds, as the server counts audio_end_ms (a float sum of the deltas' seconds
    # came to 720.0000000000001 against the server's 720 once).
    heard_ms = round(1000 * sum(wire_seconds("audio/pcm", e["delta"])
                                for e in first.of("response.output_audio.delta") if e["response_id"] == cut))
    await dropped(server, first)

    # The openai SDK resumes with the token as a query parameter.
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    async with client.realtime.connect(model="gpt-realtime", extra_query={"resume_token": token}) as rt:
        again = await rt.recv()
        assert again.type == "session.created"
        session = again.session.model_dump()
        assert session["id"] == created["id"]
        assert session["instructions"] == "Remember the pineapple."
        assert session["audio"]["output"]["voice"] == "marin"
        assert session["audio"]["input"]["turn_detection"] is None
        assert session["resume_token"] not in (None, token)
        assert waiting(server) == 0 and live(server) == 1
        # What the session sent while nobody listened comes next: the cut answer's end, and no
        # audio (what was in flight when the line dropped is never played).
        held = []
        while not held or held[-1].type != "conversation.item.truncated":
            held.append(await asyncio.wait_for(rt.recv(), TIMEOUT))
        assert "response.output_audio.delta" not in [e.type for e in held]
        done = next(e for e in held if e.type == "response.done")
        assert done.response.id == cut and done.response.status == "cancelled"
        truncated = held[-1]
        assert truncated.item_id == done.response.output[0].id
        # Cut at the audio the server wrote: at least what this client read, far from all of it.
        assert heard_ms <= truncated.audio_end_ms < ANSWER_WORDS * MS_PER_WORD / 2
        # Every item of the conversation is there, the cut answer as far as it was heard.
        for item in [e["item"] for e in first.of("conversation.item.added")]:
            assert (await retrieve(rt, item["id"])).id == item["id"]
        whole = (await retrieve(rt, answered["output"][0]["id"])).content[0].transcript
        assert whole == answered["output"][0]["content"][0]["transcript"]
        kept = await retrieve(rt, truncated.item_id)
        assert kept.status == "incomplete"
        assert done.response.output[0].content[0].transcript.startswith(kept.content[0].transcript)
        # The conversation goes on.
        await rt.conversation.item.create(item=user_text("And then?"))
        await rt.response.create(response={"max_output_tokens": SHORT_ANSWER})
        async with asyncio.timeout(TIMEOUT):
            async for event in rt:
                if event.type == "response.done":
                    assert event.response.status == "completed"
                    break
    # A client that closed (1000) is done: its session ends at once, and its token with it.
    refused = await Client.open(server, resume_token=session["resume_token"])
    assert (await refused.refused())["code"] == "invalid_resume_token"
    await released(server)


async def retrieve(rt: Any, item_id: str) -> Any:
    await rt.conversation.item.retrieve(item_id=item_id)
    async with asyncio.timeout(TIMEOUT):
        async for event in rt:
            if event.type == "conversation.item.retrieved":
                return event.item
    raise AssertionError("no conversation.item.retrieved")


async def test_tokens_are_single_use_bound_to_the_key_and_expire_with_the_grace_period(
        server: ServerProcess) -> None:
    first = await Client.open(server)
    token = (await first.until("session.created"))["session"]["resume_token"]
    await dropped(server, first)
    # The session waiting for its client holds its slot: the server (one session) has no room.
    crowded = await Client.open(server)
    assert (await crowded.until("error"))["error"]["code"] == "too_many_sessions"
    # Another credential (an ephemeral secret minted with the same key) cannot take it over.
    async with httpx.AsyncClient() as http:
        minted = (await http.post(f"{server.url}/v1/realtime/client_secrets", headers=AUTH, json={})).json()
    thief = await Client.open(server, key=minted["value"], resume_token=token)
    assert (await thief.refused())["code"] == "invalid_resume_token"
    # Its own key resumes it, once: the next token comes with the new session.created.
    second = await Client.open(server, resume_token=token)
    renewed = (await second.until("session.created"))["session"]["resume_token"]
    await dropped(server, second)
    again = await Client.open(server, resume_token=token)
    assert (await again.refused())["code"] == "invalid_resume_token"
    # Nobody comes back within the grace period: the session ends for good, and its token with it.
    await released(server)
    late = await Client.open(server, resume_token=renewed)
    assert (await late.refused())["code"] == "invalid_resume_token"
    assert "no resume within the grace period" in server.log()


async def test_a_resume_takes_over_a_socket_the_server_still_holds(server: ServerProcess) -> None:
    """After a network hand-over the old socket may look open to the server for a while: the
    token's holder gets the session, and the old socket is let go."""
    old = await Client.open(server)
    created = (await old.until("session.created"))["session"]
    new = await Client.open(server, resume_token=created["resume_token"])
    assert (await new.until("session.created"))["session"]["id"] == created["id"]
    with pytest.raises(websockets.ConnectionClosed):
        await asyncio.wait_for(old.until("never"), TIMEOUT)
    await new.send("conversation.item.create", item=user_text("Still there?"))
    await new.send("response.create", response={"max_output_tokens": SHORT_ANSWER})
    assert (await new.until("response.done"))["response"]["status"] == "completed"
    assert live(server) == 1 and waiting(server) == 0
    await new.ws.close()
    await released(server)


async def test_a_drop_while_a_function_call_waits_for_its_output_loses_nothing(
        server: ServerProcess) -> None:
    first = await Client.open(server)
    token = (await first.until("session.created"))["session"]["resume_token"]
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
    await first.send("session.update", session={"type": "realtime", "tools": [tool],
                                                "output_modalities": ["text"]})
    await first.until("session.updated")
    await first.send("conversation.item.create", item=user_text("Look it up."))
    await first.send("response.create", response={"tool_choice": "required"})
    call = (await first.until("response.done"))["response"]["output"][0]
    assert call["type"] == "function_call"
    await dropped(server, first)
    second = await Client.open(server, resume_token=token)
    await second.until("session.created")
    await second.send("conversation.item.create", item={
        "type": "function_call_output", "call_id": call["call_id"], "output": "{\"found\": 42}"})
    await second.send("response.create", response={"max_output_tokens": SHORT_ANSWER})
    done = (await second.until("response.done"))["response"]
    assert done["status"] == "completed" and done["output"][0]["type"] == "message"
    await second.ws.close()
    await released(server)


