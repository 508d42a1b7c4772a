"""A client flooding the server with events (tens of thousands, as fast as it can) gets
``rate_limited`` errors up to a bound and is then closed (WebSocket: 1008 with a reason; WebRTC: the
call ends), one sending garbage is closed after a bounded run of it, and one appending audio beyond its budget has those appends refused, while another
session on the same server still has its turn answered. A real server
of its own (no API key, so harness.calls opens WebRTC calls as they are), a raw websockets flooder,
the openai SDK for the well-behaved client."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from duplex.api.realtime_ws import PENALTY_S
from duplex.app_state import CLIENT_EVENT_BURST, CLIENT_EVENT_RATE
from duplex.session.client_events import AUDIO_BURST_S
from duplex.transports.binding import (
    EVENT_BURST,
    EVENT_RATE,
    FLOODING,
    MALFORMED,
    MAX_MALFORMED_RUN,
    MAX_RATE_ERRORS,
)
from harness.calls import open_call
from harness.server import ServerProcess, run_server, write_preset
from tests.api.helpers import PIPELINE, SHORT_ANSWER, eventually, realtime, user_text

log = logging.getLogger(__name__)

FLOOD = 20_000
# A valid event that costs the server next to nothing: the flood meets the rate limit, not the
# bound on malformed events in a row.
CHEAP_EVENT = json.dumps({"type": "input_audio_buffer.clear"})
BAD_EVENT = json.dumps({"type": "no.such.event"})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("flood")
    with run_server(write_preset(tmp / "preset.yaml", pipeline=PIPELINE), tmp=tmp) as running:
        yield running


_flooders = itertools.count(10)


def flooder_address() -> str:
    """A loopback address of its own for each flooding client (all of 127.0.0.0/8 is this
    machine's): the server limits what a client address may do over all its connections, and the
    well-behaved sessions beside the flood come from 127.0.0.1."""
    return f"127.0.0.{next(_flooders)}"


def rate_limited(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "error" and e["error"]["code"] == "rate_limited"]


def handled_bound(seconds: float) -> float:
    """The most events a flood of ``seconds`` has handled: its burst and refill."""
    return EVENT_BURST + EVENT_RATE * seconds


async def read_all(ws: ClientConnection, received: list[dict[str, Any]], first: asyncio.Event) -> None:
    """Every event until the server closes the connection."""
    try:
        async for message in ws:
            received.append(json.loads(message))
            if received[-1]["type"] == "error":
                first.set()
    except ConnectionClosed:
        pass


async def flood(ws: ClientConnection, message: str = CHEAP_EVENT) -> None:
    """Send FLOOD messages, or as many as go before the server closes the connection."""
    try:
        for _ in range(FLOOD):
            await ws.send(message)
    except ConnectionClosed:
        log.info("the server closed the flooding connection mid-flood")


def flood_without_reading(server: ServerProcess) -> float:
    """Seconds until the server cuts off a client that floods and never reads (not even the
    server's close frame, so it never answers it): a raw socket, one handshake, then masked
    frames of CHEAP_EVENT as fast as the kernel takes them."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), source_address=(flooder_address(), 0)) as sock:
        key = base64.b64encode(os.urandom(16)).decode()
        sock.sendall(f"GET /v1/realtime?model=gpt-realtime HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                     f"Sec-WebSocket-Version: 13\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 101"), head
        payload, mask = CHEAP_EVENT.encode(), os.urandom(4)
        frame = bytes([0x81, 0x80 | len(payload)]) + mask + bytes(
            b ^ mask[i % 4] for i, b in enumerate(payload))
        started = time.monotonic()
        try:
            while time.monotonic() - started < 30:
                sock.sendall(frame * 64)
        except OSError:
            return time.monotonic() - started
    raise AssertionError("a client that floods and never reads was not cut off in 30 s")


async def test_a_flood_that_never_reads_is_cut_off_soon_after_its_close(server: ServerProcess) -> None:
    """The server stops reading a flooding client once its close frame (1008) is out, answered or
    not: until then every frame that comes is parsed (uvicorn's own timeout, 10 s, kept a server
    busy that long with each such connection)."""
    elapsed = await asyncio.to_thread(flood_without_reading, server)
    assert elapsed < 5, elapsed
    assert await answered_turn(server) == "completed"


async def answered_turn(server: ServerProcess) -> str:
    """A well-behaved session's whole turn: an item, then a response; the response's status."""
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await rt.connection.conversation.item.create(item=user_text("What time is it?"))
        await rt.connection.response.create(response={"max_output_tokens": SHORT_ANSWER})
        return (await rt.wait("response.done")).response.status


async def test_a_websocket_flood_is_closed_with_1008_and_others_are_served(server: ServerProcess) -> None:
    ws_url = server.url.replace("http", "ws", 1) + "/v1/realtime?model=gpt-realtime"
    received: list[dict[str, Any]] = []
    first_error = asyncio.Event()
    async with connect(ws_url, max_queue=None, local_addr=(flooder_address(), 0)) as ws:
        started = time.monotonic()
        reader = asyncio.create_task(read_all(ws, received, first_error))
        flooding = asyncio.create_task(flood(ws))
        await first_error.wait()  # the flood is being handled: now the other session's turn
        assert await answered_turn(server) == "completed"
        await asyncio.wait_for(asyncio.gather(reader, flooding), 30)
        elapsed = time.monotonic() - started
    assert (ws.close_code, ws.close_reason) == (1008, FLOODING.reason)  # policy violation
    assert [e for e in received if e["type"] == "error"] == rate_limited(received)
    assert len(rate_limited(received)) == MAX_RATE_ERRORS
    handled = sum(e["type"] == "input_audio_buffer.cleared" for e in received)
    assert handled <= handled_bound(elapsed), (handled, elapsed)
    log.info("%d events handled in %.1f s before the 1008 close", handled, elapsed)


async def test_a_flooder_closed_with_1008_is_refused_new_sessions_for_a_while(
    server: ServerProcess,
) -> None:
    """Straight back after its 1008 (as a flooder reconnects): refused in the handshake (HTTP 429)
    for PENALTY_S, so that it cannot start over with a fresh budget; 127.0.0.1 is served."""
    ws_url = server.url.replace("http", "ws", 1) + "/v1/realtime?model=gpt-realtime"
    address = flooder_address()
    received: list[dict[str, Any]] = []
    async with connect(ws_url, max_queue=None, local_addr=(address, 0)) as ws:
        reader = asyncio.create_task(read_all(ws, received, asyncio.Event()))
        await asyncio.wait_for(asyncio.gather(reader, flood(ws)), 30)
    assert ws.close_code == 1008
    closed = time.monotonic()
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url, local_addr=(address, 0)):
            pass
    assert time.monotonic() - closed < PENALTY_S, "the test was too slow to see the penalty"
    assert refused.value.response.status_code == 429
    assert await answered_turn(server) == "completed"


async def test_a_clients_connections_share_one_event_budget(server: ServerProcess) -> None:
    """Six connections from one address flooding at once: each has a budget of its own, but the
    address has one over them all, so what the server handles is bounded by the address's."""
    ws_url = server.url.replace("http", "ws", 1) + "/v1/realtime?model=gpt-realtime"
    address, connections = flooder_address(), 6
    received: list[list[dict[str, Any]]] = [[] for _ in range(connections)]

    async def one(events: list[dict[str, Any]]) -> None:
        async with connect(ws_url, max_queue=None, local_addr=(address, 0)) as ws:
            reader = asyncio.create_task(read_all(ws, events, asyncio.Event()))
            await asyncio.gather(reader, flood(ws))

    started = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(one(events) for events in received)), 60)
    elapsed = time.monotonic() - started
    handled = sum(e["type"] == "input_audio_buffer.cleared" for events in received for e in events)
    bound = CLIENT_EVENT_BURST + CLIENT_EVENT_RATE * elapsed
    assert handled <= bound < connections * EVENT_BURST, (handled, bound)


async def test_a_stream_of_garbage_is_closed_long_before_its_rate_limit(server: ServerProcess) -> None:
    """Messages that are no event at all, as fast as they go: each gets its error until
    MAX_MALFORMED_RUN of them in a row, then the connection is closed (1008), long before the
    rate limit's burst would have ended it."""
    ws_url = server.url.replace("http", "ws", 1) + "/v1/realtime?model=gpt-realtime"
    received: list[dict[str, Any]] = []
    async with connect(ws_url, max_queue=None, local_addr=(flooder_address(), 0)) as ws:
        reader = asyncio.create_task(read_all(ws, received, asyncio.Event()))
        await asyncio.wait_for(asyncio.gather(reader, flood(ws, BAD_EVENT)), 30)
    assert (ws.close_code, ws.close_reason) == (1008, MALFORMED.reason)
    errors = [e["error"]["code"] for e in received if e["type"] == "error"]
    assert set(errors) == {"unknown_event"}
    assert MAX_MALFORMED_RUN < len(errors) < EVENT_BURST


async def test_a_data_channel_flood_ends_the_call_and_others_are_served(server: ServerProcess) -> None:
    """The call ends at once, so the events still in its outbound buffer (the rate-limit errors
    among them) are lost with it: the client sees events handled and the server's end of the
    call, and the server's log says why."""
    call = await open_call(server)
    started = time.monotonic()
    try:
        for _ in range(FLOOD):
            call.peer.channel.send(CHEAP_EVENT)
        # The flood is being handled: now the other session's turn.
        await call.wait_event("input_audio_buffer.cleared")
        assert await answered_turn(server) == "completed"
        await eventually(lambda: server.metric("duplex_sessions_active", {"transport": "webrtc"}) == 0,
                         "the flooding call to end")
        handled = sum(e["type"] == "input_audio_buffer.cleared" for e in call.events())
        assert handled <= handled_bound(time.monotonic() - started)
        call_id = call.path.rsplit("/", 1)[1]
        assert f"[{call_id}] peer closed ({FLOODING.reason})" in server.log()
    finally:
        await call.peer.close()


async def test_audio_beyond_the_connections_budget_is_refused_and_others_are_served(
        server: ServerProcess) -> None:
    """Appends of a minute of audio each, back to back: the burst (AUDIO_BURST_S) takes two, the
    third is refused before it is decoded, with an error naming the budget; the connection and
    the other sessions go on."""
    ws_url = server.url.replace("http", "ws", 1) + "/v1/realtime?model=gpt-realtime"
    minute = base64.b64encode(bytes([0xFF]) * 8000 * 60).decode("ascii")  # μ-law silence, 60 s
    assert int(AUDIO_BURST_S // 60) == 2
    received: list[dict[str, Any]] = []
    first_error = asyncio.Event()
    async with connect(ws_url, max_size=None) as ws:
        reader = asyncio.create_task(read_all(ws, received, first_error))
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}}}))
        for _ in range(3):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": minute}))
        await asyncio.wait_for(first_error.wait(), 30)
        assert await answered_turn(server) == "completed"
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        await eventually(lambda: any(e["type"] == "input_audio_buffer.cleared" for e in received),
                         "the connection to go on after the refusal")
        reader.cancel()
    (refused,) = [e for e in received if e["type"] == "error"]
    assert (refused["error"]["code"], refused["error"]["param"]) == ("rate_limited", "audio")
    assert "60.0 s" in refused["error"]["message"]


async def test_new_sessions_from_one_address_are_limited_and_open_ones_go_on(server: ServerProcess) -> None:
    """A client that reconnects again and again (as a flooder closed with 1008 would) is refused
    new sessions past its burst, in the handshake (HTTP 429, Retry-After); a session it already
    has goes on."""
    ws_url = server.url.replace("http", "ws", 1) + "/v1/realtime?model=gpt-realtime"
    async with realtime(server) as rt:
        await rt.wait("session.created")
        refusal = None
        for opened in range(60):
            try:
                async with connect(ws_url) as ws:
                    assert json.loads(await ws.recv())["type"] == "session.created"
            except InvalidStatus as err:
                refusal = err.response
                break
        assert refusal is not None, "60 new sessions in a row were all admitted"
        assert opened >= 10, f"refused after {opened} new sessions: the burst is 20"
        assert refusal.status_code == 429 and refusal.headers["Retry-After"] == "1"
        assert b"too many new sessions" in refusal.body
        # The session opened before goes on: its turn is answered.
        await rt.connection.conversation.item.create(item=user_text("What time is it?"))
        await rt.connection.response.create(response={"max_output_tokens": SHORT_ANSWER})
        assert (await rt.wait("response.done")).response.status == "completed"
