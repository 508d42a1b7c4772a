"""``--api-key``: every endpoint but ``/``, static files and ``/healthz`` requires the key.

HTTP: ``Authorization: Bearer KEY`` (401 otherwise). WebSocket: that header, or the
``openai-insecure-api-key.KEY`` subprotocol that OpenAI's browser SDK sends (the server then answers
with the ``realtime`` subprotocol); a refused WebSocket is closed with 1008 before any event.
"""

from __future__ import annotations

import hmac

from fastapi import Request, WebSocket

from duplex.api.errors import APIError
from duplex.app_state import AppState

SUBPROTOCOL_PREFIX = "openai-insecure-api-key."


def app_state(request: Request) -> AppState:
    return request.app.state.duplex


def _matches(given: str | None, key: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


def _bearer(header: str | None) -> str | None:
    if header and header.lower().startswith("bearer "):
        return header[7:].strip()
    return None


def require_key(request: Request) -> None:
    """FastAPI dependency for HTTP endpoints."""
    key = app_state(request).settings.api_key
    if key is None:
        return
    if not _matches(_bearer(request.headers.get("authorization")), key):
        raise APIError(401, "missing or invalid API key (Authorization: Bearer KEY)", "invalid_api_key",
                       kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})


def websocket_key_ok(websocket: WebSocket, key: str | None, query_token: str | None = None) -> bool:
    """Whether a WebSocket carries the key (header, subprotocol, or a token where allowed)."""
    if key is None:
        return True
    if _matches(_bearer(websocket.headers.get("authorization")), key):
        return True
    for protocol in websocket.scope.get("subprotocols", []):
        if protocol.startswith(SUBPROTOCOL_PREFIX) and _matches(protocol[len(SUBPROTOCOL_PREFIX):], key):
            return True
    return _matches(query_token, key)


def websocket_subprotocol(websocket: WebSocket) -> str | None:
    """The subprotocol to answer with: ``realtime`` when the client offered OpenAI's."""
    offered = websocket.scope.get("subprotocols", [])
    if "realtime" in offered or any(p.startswith(SUBPROTOCOL_PREFIX) for p in offered):
        return "realtime"
    return None
