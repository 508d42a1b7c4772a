"""DNS rebinding: without ``--api-key``, a page whose name was rebound to the server's address is
"same-origin" with it (``Origin`` and ``Host`` both name the attacker's host), so the server
answers only the ``Host`` names it knows: loopback names, IP addresses, ``--host``, and
``--allowed-host``. A real key-less server, raw requests with the ``Host`` a browser would send."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from duplex.origin_guard import AllowedHosts
from harness.server import ServerProcess, run_server, write_preset
from tests.api.helpers import SHORT_ANSWER, TIMEOUT

ALLOWED = "duplex.example"


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("host_guard")
    with run_server(write_preset(tmp / "preset.yaml"), "--allowed-host", ALLOWED, tmp=tmp) as running:
        yield running


def port(server: ServerProcess) -> int:
    return urlsplit(server.url).port or 80


async def chat_from_page(server: ServerProcess, host: str) -> httpx.Response:
    """A chat completion as a page at ``http://{host}`` (its own origin) posts it."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        return await http.post(f"{server.url}/v1/chat/completions", headers={
            "Host": host, "Origin": f"http://{host}"}, json={
            "model": "m", "max_completion_tokens": SHORT_ANSWER,
            "messages": [{"role": "user", "content": "hi"}]})


async def test_a_rebound_name_is_refused(keyless: ServerProcess) -> None:
    refused = await chat_from_page(keyless, f"evil.test:{port(keyless)}")
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "host_not_allowed" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("name", ["localhost", "127.0.0.1", "[::1]", "127.0.1.1", ALLOWED])
async def test_loopback_addresses_and_allowed_names_are_served(keyless: ServerProcess, name: str) -> None:
    answered = await chat_from_page(keyless, f"{name}:{port(keyless)}")
    assert answered.status_code == 200, answered.text


async def realtime_from_page(server: ServerProcess, host: str) -> int:
    """The handshake status of the Realtime WebSocket a page at ``http://{host}`` opens."""
    with socket.create_connection(("127.0.0.1", port(server)), timeout=TIMEOUT) as sock:
        try:
            async with connect(f"ws://{host}/v1/realtime?model=m", sock=sock, origin=f"http://{host}",
                               open_timeout=TIMEOUT):  # type: ignore[arg-type]
                return 101
        except InvalidStatus as refused:
            return refused.response.status_code


async def test_the_realtime_websocket_checks_the_host_too(keyless: ServerProcess) -> None:
    assert await realtime_from_page(keyless, f"evil.test:{port(keyless)}") == 403
    assert await realtime_from_page(keyless, f"localhost:{port(keyless)}") == 101


def test_which_names_a_server_answers() -> None:
    """Bound to every interface: any IP address (nothing to rebind), but names only when allowed."""
    everywhere = AllowedHosts("0.0.0.0")
    assert "192.168.1.5:8000" in everywhere and "[fe80::1]:8000" in everywhere
    assert "app.localhost:8000" in everywhere and "LOCALHOST." in everywhere
    assert "nas.lan:8000" not in everywhere and "localhost.evil.test" not in everywhere
    assert "gpu-box.lan:8000" in AllowedHosts("gpu-box.lan")
    assert "anything.example" in AllowedHosts("::", ["*"])
