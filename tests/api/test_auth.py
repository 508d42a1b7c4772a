"""``--api-key`` everywhere CONTRACT.md says: 401 on HTTP, 1008 on WebSocket, the key as a header or
as OpenAI's browser subprotocol; ``/healthz`` stays open. Real server, real SDK, raw websockets."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from harness.server import ServerProcess
from tests.api.helpers import API_KEY, SHORT_ANSWER, realtime

PROTECTED = [("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("POST", "/v1/realtime/calls"),
             ("POST", "/v1/realtime/calls/rtc_x/hangup")]


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", API_KEY, f"Basic {API_KEY}"])
async def test_http_refuses_without_the_key(server: ServerProcess,
                                            authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    async with httpx.AsyncClient(headers=headers) as http:
        for method, path in PROTECTED:
            response = await http.request(method, f"{server.url}{path}", json={})
            assert response.status_code == 401, (path, response.text)
            error = response.json()["error"]
            assert error["type"] == "authentication_error" and "API key" in error["message"]
        assert (await http.get(f"{server.url}/healthz")).status_code == 200


async def test_sdk_with_the_right_key_works_and_a_wrong_one_does_not(server: ServerProcess) -> None:
    hello = [{"role": "user", "content": "hi"}]
    async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="wrong-key") as wrong:
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="m", messages=hello)
    async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY) as right:
        answer = await right.chat.completions.create(model="m", messages=hello,
                                                     max_completion_tokens=SHORT_ANSWER)
    assert answer.choices[0].message.content


async def test_websocket_with_a_wrong_key_closes_1008_first(server: ServerProcess) -> None:
    """Closed before any event: not even session.created."""
    async with realtime(server, api_key="wrong-key") as rt:
        await rt.wait_for(lambda: rt.ended)
    assert rt.closed is not None and rt.closed.rcvd is not None and rt.closed.rcvd.code == 1008
    assert rt.events == []


def ws_url(server: ServerProcess) -> str:
    return server.url.replace("http://", "ws://") + "/v1/realtime?model=gpt-realtime"


@pytest.mark.parametrize("subprotocols", [None, ["realtime", "openai-insecure-api-key.wrong-key"]])
async def test_websocket_without_the_key_is_closed_1008(server: ServerProcess,
                                                        subprotocols: list[str] | None) -> None:
    async with connect(ws_url(server), subprotocols=subprotocols) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


async def test_websocket_key_as_browser_subprotocol(server: ServerProcess) -> None:
    offered = ["realtime", f"openai-insecure-api-key.{API_KEY}"]
    async with connect(ws_url(server), subprotocols=offered) as ws:
        assert ws.subprotocol == "realtime"
        created = json.loads(await ws.recv())
    assert created["type"] == "session.created" and created["session"]["model"] == "gpt-realtime"
