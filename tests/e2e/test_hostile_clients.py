"""Clients that misbehave on purpose, while another session keeps talking: the server stays up,
the bad client is ended or answered with errors, and the good session is answered throughout."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
import websockets

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


async def test_a_client_that_never_reads_is_ended_and_others_are_served(server: ServerProcess) -> None:
    url = server.url.replace("http://", "ws://") + "/v1/realtime?model=m"
    good = await open_call(server)
    # max_queue=1: the client library stops reading the socket at once, like a client that hangs.
    async with websockets.connect(url, max_queue=1) as deaf:
        # Each echo (session.updated) carries the 90 kB instructions: ~90 of them pass the 8 MiB of
        # unsent events, well before the event rate limit (bursts of 1,000) could end it instead.
        update = json.dumps({"type": "session.update", "session": {"instructions": "x" * 90_000}})
        ended = False
        async with asyncio.timeout(TIMEOUT):
            for _ in range(EVENT_BURST - 100):
                try:
                    await deaf.send(update)
                except websockets.ConnectionClosed:
                    ended = True
                    break
            if not ended:  # every update was sent: the server ends the session meanwhile
                while await sessions(server, "websocket") > 0:
                    await asyncio.sleep(0.1)  # a gauge of another process: polled
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
