"""Who the client is, for the limits the server keeps per client address (``AppState.new_sessions``,
``AppState.client_events``).

Behind a reverse proxy every connection comes from the proxy. :class:`ProxyHeaders` takes the
client's address from ``X-Forwarded-For`` (else RFC 7239 ``Forwarded``) and its scheme from
``X-Forwarded-Proto`` (else ``Forwarded``'s ``proto``), and only when the connection comes from a
proxy in ``--forwarded-allow-ips``; by default from none, so that no client can name itself
(uvicorn's own proxy support, which serve.py turns off, trusts 127.0.0.1 by default, ignores
``Forwarded`` and takes a malformed entry of its list for a name). In the list of hops each proxy
appends to, the client is the last entry that is not a trusted proxy, as uvicorn does.

:func:`limit_key` then keys an IPv6 client by its /64: one subscriber usually holds a whole /64,
and would otherwise get a fresh budget from each of its 2**64 addresses.

One middleware for the app's life; it holds no per-request state.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

IPV6_PREFIX = 64
_SCHEMES = {"http", "https", "ws", "wss"}
# A Forwarded parameter (``for=…``, ``proto="…"``), or the comma that ends a hop's element. Bounded
# repetitions: a long header a proxy passed on costs linear time.
_TOKEN = re.compile(r'([A-Za-z]{1,32})\s*=\s*("(?:[^"\\]|\\.){0,256}"|[^;,\s"]{0,256})|,')


class TrustedProxies:
    """``--forwarded-allow-ips``: comma-separated addresses and networks, ``*`` for any peer, empty
    or None for none. A malformed entry is a ValueError (at start-up), never silently ignored."""

    def __init__(self, spec: str | None) -> None:
        entries = [e.strip() for e in (spec or "").split(",") if e.strip()]
        self.any = "*" in entries
        try:
            self.networks = [ipaddress.ip_network(e, strict=False) for e in entries if e != "*"]
        except ValueError as err:
            raise ValueError(f"--forwarded-allow-ips: {err}") from None

    def __contains__(self, host: str | None) -> bool:
        if self.any:
            return True
        address = _ip(host)
        return address is not None and any(address in network for network in self.networks)


def _ip(host: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:1.2.3.4 is the IPv4 client 1.2.3.4
    return mapped or address


def _node_host(node: str) -> str:
    """The address of a hop: ``1.2.3.4``, ``1.2.3.4:80``, ``[2001:db8::1]:80``, a bare IPv6
    address (X-Forwarded-For), or an obfuscated name (``_hidden``, ``unknown``) as it is."""
    node = node.strip().strip('"')
    if node.startswith("["):
        return node[1:].partition("]")[0]
    if node.count(":") == 1:
        return node.partition(":")[0]
    return node


def _header(scope: Scope, name: bytes) -> str | None:
    """All of the request's ``name`` headers, joined as one list."""
    values = [v.decode("latin-1") for k, v in scope.get("headers", []) if k == name]
    return ", ".join(values) if values else None


def _forwarded(value: str) -> list[dict[str, str]]:
    """RFC 7239 ``Forwarded``: one dict of (lower-case) parameters per hop, first hop first."""
    hops: list[dict[str, str]] = [{}]
    for match in _TOKEN.finditer(value):
        if match[1] is None:
            hops.append({})
        else:
            hops[-1][match[1].lower()] = match[2].strip('"').replace('\\"', '"')
    return hops


# A hop named in the proxy headers: its address and the scheme it used (where they say).
Hop = tuple[str, str | None]


def forwarded_hops(scope: Scope) -> list[Hop] | None:
    """The hops the proxy headers name, client first, or None without them."""
    xff = _header(scope, b"x-forwarded-for")
    if xff is not None:
        proto = _header(scope, b"x-forwarded-proto")
        scheme = proto.split(",")[0].strip() if proto else None  # the client-facing proxy's
        return [(_node_host(node), scheme) for node in xff.split(",")]
    forwarded = _header(scope, b"forwarded")
    if forwarded is not None:
        return [(_node_host(hop.get("for", "")), hop.get("proto")) for hop in _forwarded(forwarded)]
    return None


def client_hop(hops: list[Hop], trusted: TrustedProxies) -> Hop:
    """The last hop that is not a trusted proxy; the first when all are."""
    return next((hop for hop in reversed(hops) if hop[0] not in trusted), hops[0])


class ProxyHeaders:
    """Rewrites ``scope["client"]`` and ``scope["scheme"]`` from a trusted proxy's headers."""

    def __init__(self, app: ASGIApp, trusted: TrustedProxies) -> None:
        self.app = app
        self.trusted = trusted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        peer = scope.get("client")
        if scope["type"] in ("http", "websocket") and peer and peer[0] in self.trusted:
            hops = forwarded_hops(scope)
            if hops:
                self._rewrite(scope, *client_hop(hops, self.trusted))
        await self.app(scope, receive, send)

    @staticmethod
    def _rewrite(scope: Scope, client: str, proto: str | None) -> None:
        if client:
            scope["client"] = (client, 0)
        proto = (proto or "").lower()
        if proto in _SCHEMES:
            secure = proto in ("https", "wss")
            websocket = scope["type"] == "websocket"
            scope["scheme"] = ("wss" if secure else "ws") if websocket else ("https" if secure else "http")


def limit_key(client: Any) -> str:
    """The key of a client's per-address budgets (``client``: a Starlette ``Address`` or None):
    its IPv4 address, its IPv6 /64, or whatever else names it."""
    host = client.host if client is not None else None
    address = _ip(host)
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, IPV6_PREFIX), strict=False))
    return str(address) if address is not None else host or "unknown"
