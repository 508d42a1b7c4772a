"""``POST /v1/realtime/client_secrets``: short-lived client keys, as OpenAI's ephemeral-key flow.

A backend that holds the API key mints an ``ek_...`` secret and hands it to a browser or app, which
then uses it exactly like the API key on ``POST /v1/realtime/calls`` and ``GET /v1/realtime``. A
secret may carry a ``session`` configuration: the session it opens starts with it.

The secrets live in the server's ``duplex.api.ephemeral_keys.ClientSecrets``, each until it expires
(``expires_after.seconds``, 10 s to 2 h, default 10 min).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request

from duplex.api.auth import app_state, require_api_key
from duplex.api.ephemeral_keys import client_secrets
from duplex.api.errors import ERROR_RESPONSES, APIError, read_body
from duplex.protocol.events import new_id
from duplex.protocol.session_update import apply_session_update, session_object

# Minting takes the real key.
router = APIRouter(dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES)

DEFAULT_TTL_S, MIN_TTL_S, MAX_TTL_S = 600, 10, 7200


def _ttl(body: dict[str, Any]) -> int:
    expires = body.get("expires_after") or {}
    if not isinstance(expires, dict):
        raise APIError(400, "expires_after must be an object", "invalid_value", param="expires_after")
    if expires.get("anchor", "created_at") != "created_at":
        raise APIError(400, "expires_after.anchor must be 'created_at'", "invalid_value",
                       param="expires_after.anchor")
    seconds = expires.get("seconds", DEFAULT_TTL_S)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not MIN_TTL_S <= seconds <= MAX_TTL_S:
        raise APIError(400, f"expires_after.seconds must be {MIN_TTL_S}..{MAX_TTL_S}", "invalid_value",
                       param="expires_after.seconds")
    return seconds


# The body is validated by hand (``_ttl``, ``apply_session_update``); this declares it for the
# OpenAPI document.
BODY_SCHEMA = {"type": "object", "properties": {
    "expires_after": {"type": "object", "properties": {
        "anchor": {"const": "created_at"},
        "seconds": {"type": "integer", "minimum": MIN_TTL_S, "maximum": MAX_TTL_S}}},
    "session": {"type": "object", "description": "a session configuration, as in session.update"},
}}


@router.post("/v1/realtime/client_secrets", openapi_extra={"requestBody": {
    "required": False, "content": {"application/json": {"schema": BODY_SCHEMA}}}})
async def create_client_secret(request: Request) -> dict[str, Any]:
    state = app_state(request)
    raw = await read_body(request)
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise APIError(400, "the body is not JSON", "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", "invalid_value")
    ttl = _ttl(body)
    session = body.get("session")
    defaults = state.settings.session
    config = defaults.session_config()
    if session is not None:
        if not isinstance(session, dict):
            raise APIError(400, "session must be an object", "invalid_value", param="session")
        config, errors = apply_session_update(config, session, [*state.settings.voices, *defaults.voice_map],
                                              defaults.mcp_servers)
        if errors:
            raise APIError(400, errors[0].message, errors[0].code, param=errors[0].param)
    secret = client_secrets(request.app.state).mint(ttl, session)
    model = session.get("model") if session and isinstance(session.get("model"), str) else None
    return {"value": secret.value, "expires_at": int(secret.expires_at),
            "session": session_object(new_id("sess"), config, model or state.settings.preset)}
