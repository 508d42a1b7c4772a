"""``--api-key``: every endpoint but ``/``, static files and ``/healthz`` requires the key, or a live
ephemeral client secret minted with it (``duplex.api.client_secrets``; minting itself takes the key).

HTTP: ``Authorization: Bearer KEY`` (401 otherwise). WebSocket: that header, or the
``openai-insecure-api-key.KEY`` subprotocol that OpenAI's browser SDK sends (the server then answers
with the ``realtime`` subprotocol); a refused WebSocket is closed with 1008 before any event.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Request, WebSocket

from duplex.api.ephemeral_keys import ClientSecret, client_secrets
from duplex.api.errors import APIError
from duplex.app_state import AppState

SUBPROTOCOL_PREFIX = "openai-insecure-api-key."


def app_state(request: Request) -> AppState:
    return request.app.state.duplex


def _matches(given: str | None, key: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


def token_ok(key: str | None, *given: str | None) -> bool:
    """No key configured, or one of ``given`` (tokens from where a client cannot send headers:
    Twilio's query and ``customParameters``) is it; compared in constant time."""
    return key is None or any(_matches(g, key) for g in given)


def _bearer(header: str | None) -> str | None:
    if header and header.lower().startswith("bearer "):
        return header[7:].strip()
    return None


def _secret(app_state_holder: Any, given: str | None) -> ClientSecret | None:
    return client_secrets(app_state_holder).check(given)


def _refused() -> APIError:
    return APIError(401, "missing or invalid API key (Authorization: Bearer KEY)", "invalid_api_key",
                    kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})


def require_api_key(request: Request) -> None:
    """FastAPI dependency: the API key itself (no ephemeral secret)."""
    key = app_state(request).settings.api_key
    if key is not None and not _matches(_bearer(request.headers.get("authorization")), key):
        raise _refused()


def require_key(request: Request) -> None:
    """FastAPI dependency for HTTP endpoints: the API key or a live client secret."""
    key = app_state(request).settings.api_key
    if key is None:
        return
    given = _bearer(request.headers.get("authorization"))
    if not _matches(given, key) and _secret(request.app.state, given) is None:
        raise _refused()


def request_credential(request: Request) -> str | None:
    """The key or client secret an HTTP request presents (``Authorization: Bearer``), or None:
    what a resumable WebRTC call is bound to (``duplex.session.resume`` keeps only a digest)."""
    return _bearer(request.headers.get("authorization")) or None


def request_secret(request: Request) -> ClientSecret | None:
    """The live client secret an HTTP request carries, or None."""
    return _secret(request.app.state, _bearer(request.headers.get("authorization")))


def _websocket_keys(websocket: WebSocket) -> list[str]:
    given = [_bearer(websocket.headers.get("authorization"))]
    given += [p[len(SUBPROTOCOL_PREFIX):] for p in websocket.scope.get("subprotocols", [])
              if p.startswith(SUBPROTOCOL_PREFIX)]
    return [g for g in given if g]


def websocket_credential(websocket: WebSocket) -> str | None:
    """The key or client secret the WebSocket presents (header, else subprotocol), or None: what
    a resumable session is bound to (``duplex.session.resume`` keeps only a digest of it)."""
    return next(iter(_websocket_keys(websocket)), None)


def websocket_secret(websocket: WebSocket) -> ClientSecret | None:
    """The live client secret the WebSocket carries (header or subprotocol), or None."""
    return next((s for g in _websocket_keys(websocket)
                 if (s := _secret(websocket.app.state, g)) is not None), None)


def websocket_key_ok(websocket: WebSocket, key: str | None, query_token: str | None = None) -> bool:
    """Whether a WebSocket carries the key or a live client secret (header, subprotocol), or a
    token where allowed."""
    if key is None:
        return True
    if any(_matches(g, key) for g in _websocket_keys(websocket)):
        return True
    return token_ok(key, query_token) or websocket_secret(websocket) is not None


def websocket_subprotocol(websocket: WebSocket) -> str | None:
    """The subprotocol to answer with: ``realtime`` when the client offered OpenAI's."""
    offered = websocket.scope.get("subprotocols", [])
    if "realtime" in offered or any(p.startswith(SUBPROTOCOL_PREFIX) for p in offered):
        return "realtime"
    return None
