"""``GET /v1/realtime/ice_servers``: the STUN and TURN servers the server's own peers use
(``--ice-server``), for the browser page to use as well: a caller beyond the LAN reaches the
server through the same TURN relay. Guarded like the calls (the API key, or the same-origin guard
without one): TURN credentials are for this server's callers only.

The list is in the browser's ``RTCIceServer`` shape; empty when no server was given (then neither
side uses STUN or TURN: never a public server implicitly).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from duplex.api.auth import app_state, require_key
from duplex.api.errors import ERROR_RESPONSES

router = APIRouter(dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)


@router.get("/v1/realtime/ice_servers")
async def ice_servers(request: Request) -> dict[str, Any]:
    servers = []
    for server in app_state(request).policy.servers:
        entry: dict[str, Any] = {"urls": [server.urls] if isinstance(server.urls, str) else server.urls}
        if server.username is not None:
            entry["username"], entry["credential"] = server.username, server.credential
        servers.append(entry)
    return {"ice_servers": servers}
