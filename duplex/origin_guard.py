"""Browser-reachable endpoints refuse other sites' pages when no API key protects them.

A page on another site can make the user's browser call a server on localhost (a POST with an SDP
body, a WebSocket) — the browser sends its ``Origin`` but nothing stops the request. Without
``--api-key`` the server is open to anything that can reach it, so it accepts browser requests
only from its own origin (the page it serves); clients that are not browsers send no ``Origin``
and are not affected. With an API key, a foreign page has no key: the key is the check.

One ASGI middleware for the app's whole life; it holds no per-request state.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

CLOSE_POLICY_VIOLATION = 1008


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def same_origin(scope: Scope) -> bool:
    """No ``Origin`` (not a browser), or one naming the host the request was sent to."""
    origin = _header(scope, b"origin")
    if origin is None:
        return True
    host = _header(scope, b"host")
    return host is not None and urlsplit(origin).netloc.lower() == host.lower()


class OriginGuard:
    def __init__(self, app: ASGIApp, enabled: bool) -> None:
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled or scope["type"] not in ("http", "websocket") or same_origin(scope):
            await self.app(scope, receive, send)
            return
        message = "requests from another site's page are refused (use --api-key to open the API)"
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": CLOSE_POLICY_VIOLATION, "reason": message})
            return
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": "cross_origin"}}).encode()
        headers: list[tuple[bytes, Any]] = [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 403, "headers": headers})
        await send({"type": "http.response.body", "body": body})
