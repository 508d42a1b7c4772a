"""Clients that misbehave on purpose, while another session keeps talking: the server stays up,
the bad client is ended or answered with errors, and the good session is answered throughout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Iterator

import pytest
from websockets.client import ClientProtocol
from websockets.uri import parse_uri

from duplex.transports.binding import EVENT_BURST
from harness.calls import QUESTION, hang_up, open_call
from harness.server import ServerProcess, run_server, write_preset
from harness.speech import speech

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("hostile")
    with run_server(write_preset(tmp / "preset.yaml"), tmp=tmp) as running:
        yield running


async def sessions(server: ServerProcess, transport: str) -> float:
    return server.metric("duplex_sessions_active", {"transport": transport})


async def deaf_client(url: str) -> tuple[ClientProtocol, asyncio.StreamWriter]:
    """A WebSocket client that never reads a byte after its handshake: a socket with a small
    receive buffer, driven by websockets' sans-I/O protocol (a client library would go on reading
    into its own memory, and the server's sends would go on draining)."""
    uri = parse_uri(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (uri.host, uri.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    protocol = ClientProtocol(uri, max_size=None)
    protocol.send_request(protocol.connect())
    writer.write(b"".join(protocol.data_to_send()))
    protocol.receive_data(await reader.readuntil(b"\r\n\r\n"))
    assert protocol.handshake_exc is None, protocol.handshake_exc
    return protocol, writer


async def test_a_client_that_never_reads_is_ended_and_others_are_served(server: ServerProcess) -> None:
    url = server.url.replace("http://", "ws://") + "/v1/realtime?model=m"
    good = await open_call(server)
    protocol, deaf = await deaf_client(url)
    # Each echo (session.updated) carries the 90 kB instructions: ~90 of them past what the
    # sockets hold pass the 8 MiB of unsent events, well before the event rate limit (bursts of
    # 1,000) could end it instead.
    update = json.dumps({"type": "session.update", "session": {"instructions": "x" * 90_000}})
    async with asyncio.timeout(TIMEOUT):
        for _ in range(EVENT_BURST - 100):
            protocol.send_text(update.encode())
            deaf.write(b"".join(protocol.data_to_send()))
            # The server stops reading once it ended the session (its close frame waits on our
            # never-read socket): past a second without draining, see whether it has.
            with contextlib.suppress(TimeoutError, ConnectionError):
                await asyncio.wait_for(deaf.drain(), 1.0)
            if deaf.transport.get_write_buffer_size() and await sessions(server, "websocket") == 0:
                break
        while await sessions(server, "websocket") > 0:
            await asyncio.sleep(0.1)  # a gauge of another process: polled
    deaf.transport.abort()
    assert "reads none of its last" in server.log()
    # The WebRTC session was answered as usual, during and after the flood.
    await good.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    done = await good.wait_event("response.done")
    assert done["response"]["status"] == "completed"
    await hang_up(server, good)
    assert await sessions(server, "websocket") == 0


async def test_malformed_session_updates_on_the_data_channel_get_errors_not_a_dead_handler(
        server: ServerProcess) -> None:
    call = await open_call(server)
    bad = [{"type": "session.update", "session": {"output_modalities": [{}]}},
           {"type": "session.update", "session": {"audio": {"output": "x"}}},
           {"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
               "type": "server_vad", "prefix_padding_ms": 10**9}}}}}]
    for event in bad:
        call.peer.send(event)
    call.peer.channel.send("[" * 100_000)  # deeper than any JSON parser recursion
    call.peer.send({"type": "session.update", "session": {"instructions": "Still alive."}})
    await call.wait_event("session.updated", session__instructions="Still alive.")
    errors = [e for e in call.events() if e["type"] == "error"]
    assert len(errors) == len(bad) + 1, errors
    assert any("prefix_padding_ms" in (e["error"]["param"] or "") for e in errors)
    await hang_up(server, call)
