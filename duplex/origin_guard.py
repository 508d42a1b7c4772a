"""Browser-reachable endpoints refuse other sites' pages when no API key protects them.

A page on another site can make the user's browser call a server on localhost (a POST with an SDP
body, a WebSocket) — the browser sends its ``Origin`` but nothing stops the request. Without
``--api-key`` the server is open to anything that can reach it, so it accepts browser requests
only from its own origin (the page it serves); clients that are not browsers send no ``Origin``
and are not affected. With an API key, a foreign page has no key: the key is the check.

Same-origin is not enough on its own: a page whose DNS name is rebound to this server's address
(DNS rebinding) is "same-origin" with it, ``Origin`` and ``Host`` both naming the attacker's
host. So the ``Host`` a request names must be one this server answers to (:class:`AllowedHosts`):
a loopback name, an IP address (no name to rebind), ``--host`` when it is a name, or an
``--allowed-host``. Starlette's ``TrustedHostMiddleware`` knows neither loopback ranges nor IP
literals and answers in plain text, hence these few lines.

One ASGI middleware for the app's whole life; it holds no per-request state.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

CLOSE_POLICY_VIOLATION = 1008
WILDCARD_BINDS = {"", "0.0.0.0", "::"}


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def _name(host: str) -> str:
    """A ``Host`` value's name or address: no port, no IPv6 brackets, lower case, no final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class AllowedHosts:
    """The ``Host`` names this server answers to without an API key: ``localhost`` and
    ``*.localhost`` (browsers resolve them to loopback themselves), any IP address, ``--host``
    unless it is a wildcard bind, and each ``--allowed-host`` (``*``: any name)."""

    def __init__(self, bind_host: str, allowed: Iterable[str] = ()) -> None:
        names = {_name(name) for name in allowed}
        if bind_host not in WILDCARD_BINDS:
            names.add(_name(bind_host))
        self.names = frozenset(names)

    def __contains__(self, host: str) -> bool:
        name = _name(host)
        return (name == "localhost" or name.endswith(".localhost") or _is_ip(name)
                or name in self.names or "*" in self.names)


def same_origin(scope: Scope) -> bool:
    """No ``Origin`` (not a browser), or one naming the host the request was sent to."""
    origin = _header(scope, b"origin")
    if origin is None:
        return True
    host = _header(scope, b"host")
    return host is not None and urlsplit(origin).netloc.lower() == host.lower()


class OriginGuard:
    def __init__(self, app: ASGIApp, enabled: bool, hosts: AllowedHosts) -> None:
        self.app = app
        self.enabled = enabled
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = _header(scope, b"host")
        if host is not None and host not in self.hosts:
            # Every browser sends Host; a client without one is not a page, and not rebound.
            await _refuse(scope, send, f"this server does not answer to the name {_name(host)!r} "
                          "(add it with --allowed-host, or use --api-key)", "host_not_allowed")
        elif not same_origin(scope):
            await _refuse(scope, send, "requests from another site's page are refused "
                          "(use --api-key to open the API)", "cross_origin")
        else:
            await self.app(scope, receive, send)


async def _refuse(scope: Scope, send: Send, message: str, code: str) -> None:
    """WebSocket: close 1008 before accepting; HTTP: 403 with an OpenAI-style error body."""
    if scope["type"] == "websocket":
        # A close reason is at most 123 bytes.
        reason = message.encode()[:120].decode(errors="ignore")
        await send({"type": "websocket.close", "code": CLOSE_POLICY_VIOLATION, "reason": reason})
        return
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    headers: list[tuple[bytes, Any]] = [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 403, "headers": headers})
    await send({"type": "http.response.body", "body": body})
