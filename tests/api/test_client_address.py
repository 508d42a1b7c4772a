"""Per-address limits behind a reverse proxy: the client address comes from ``X-Forwarded-For`` /
``Forwarded`` only when the connection comes from a proxy in ``--forwarded-allow-ips`` (none by
default, loopback included), and an IPv6 client is one /64.

Black-box: two real servers, one trusting 127.0.0.1 and one trusting nobody, and two "users"
behind the proxy opening Realtime sessions until the new-session limit (20 at once, then 2 a
second, per address) refuses one of them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from duplex.client_address import ProxyHeaders, TrustedProxies, limit_key
from harness.server import ServerProcess, run_server, write_preset
from tests.api.helpers import TIMEOUT

TOO_MANY = 429
USER_A = {"X-Forwarded-For": "203.0.113.1"}
USER_B = {"Forwarded": 'for="203.0.113.2:4711";proto=http'}
# More than the limit's burst (20) plus what it refills while these handshakes run.
MAX_ATTEMPTS = 80


def _server(tmp_path_factory: pytest.TempPathFactory, *args: str) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("client_address")
    with run_server(write_preset(tmp / "preset.yaml", max_sessions=2), *args, tmp=tmp) as running:
        yield running


@pytest.fixture(scope="module")
def behind_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server(tmp_path_factory, "--forwarded-allow-ips", "127.0.0.1")


@pytest.fixture(scope="module")
def trusting_nobody(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server(tmp_path_factory)


async def handshake(server: ServerProcess, headers: dict[str, str]) -> int:
    """The HTTP status of a Realtime WebSocket handshake (101: a session was opened)."""
    url = server.url.replace("http://", "ws://") + "/v1/realtime?model=m"
    try:
        async with connect(url, additional_headers=headers, open_timeout=TIMEOUT):
            return 101
    except InvalidStatus as refused:
        return refused.response.status_code


async def lock_out(server: ServerProcess, headers: dict[str, str]) -> None:
    """Open sessions as one user until the new-session limit refuses it."""
    for _ in range(MAX_ATTEMPTS):
        if await handshake(server, headers) == TOO_MANY:
            return
    pytest.fail(f"{MAX_ATTEMPTS} sessions opened without a 429")


async def test_users_behind_a_trusted_proxy_have_their_own_budgets(behind_proxy: ServerProcess) -> None:
    await lock_out(behind_proxy, USER_A)
    await lock_out(behind_proxy, {})  # the proxy's own address (a request that names no client)
    # B's budget is whole: sharing A's or the proxy's (refilling at 2 a second), it would be
    # refused within a few.
    statuses = [await handshake(behind_proxy, USER_B) for _ in range(15)]
    assert statuses == [101] * 15


async def test_proxy_headers_are_ignored_unless_the_proxy_is_trusted(
        trusting_nobody: ServerProcess) -> None:
    """Not even from loopback: without the option, a client cannot name itself anew."""
    await lock_out(trusting_nobody, USER_A)
    statuses = [await handshake(trusting_nobody, USER_B) for _ in range(5)]
    assert TOO_MANY in statuses


# --- units ----------------------------------------------------------------------------------------

class Address:
    def __init__(self, host: str) -> None:
        self.host = host


def test_ipv6_clients_are_keyed_by_their_64() -> None:
    one = limit_key(Address("2001:db8:1:2:3:4:5:6"))
    assert one == limit_key(Address("2001:db8:1:2:ffff::1")) == "2001:db8:1:2::/64"
    assert one != limit_key(Address("2001:db8:1:3::1"))
    assert limit_key(Address("203.0.113.7")) != limit_key(Address("203.0.113.8"))
    assert limit_key(Address("::ffff:203.0.113.7")) == limit_key(Address("203.0.113.7")) == "203.0.113.7"
    assert limit_key(None) == "unknown"


async def rewritten(trusted: str | None, peer: str, headers: dict[str, str],
                    kind: str = "http") -> tuple[str, str]:
    """(client host, scheme) the app sees behind ProxyHeaders."""
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.update(scope)

    scope = {"type": kind, "client": (peer, 1234), "scheme": "ws" if kind == "websocket" else "http",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    await ProxyHeaders(app, TrustedProxies(trusted))(scope, None, None)  # type: ignore[arg-type]
    return seen["client"][0], seen["scheme"]


async def test_the_client_is_the_last_hop_that_is_not_a_trusted_proxy() -> None:
    chain = {"X-Forwarded-For": "198.51.100.9, 203.0.113.5, 10.0.0.2", "X-Forwarded-Proto": "https"}
    assert await rewritten("10.0.0.0/8", "10.0.0.1", chain) == ("203.0.113.5", "https")
    assert await rewritten("10.0.0.0/8, 203.0.113.5", "10.0.0.1", chain) == ("198.51.100.9", "https")
    assert await rewritten("*", "192.0.2.1", chain) == ("198.51.100.9", "https")
    # The peer is not a trusted proxy: its headers say nothing.
    assert await rewritten("10.0.0.0/8", "192.0.2.1", chain) == ("192.0.2.1", "http")
    assert await rewritten(None, "127.0.0.1", chain) == ("127.0.0.1", "http")


async def test_rfc_7239_forwarded() -> None:
    header = {"Forwarded": 'for=192.0.2.60;proto=http, For="[2001:db8:cafe::17]:4711";proto=https'}
    assert await rewritten("127.0.0.1", "127.0.0.1", header) == ("2001:db8:cafe::17", "https")
    assert await rewritten("127.0.0.1", "127.0.0.1", header, "websocket") == ("2001:db8:cafe::17", "wss")
    # The scheme is the one the client's own hop used.
    trusted = "127.0.0.1, 2001:db8:cafe::/48"
    assert await rewritten(trusted, "127.0.0.1", header) == ("192.0.2.60", "http")


def test_a_malformed_trust_list_is_refused() -> None:
    with pytest.raises(ValueError, match="forwarded-allow-ips"):
        TrustedProxies("10.0.0.0/8, proxy.example")
