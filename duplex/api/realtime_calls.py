"""WebRTC calls as OpenAI's WebRTC flow does them (CONTRACT.md):

``POST /v1/realtime/calls`` with an SDP offer (``application/sdp``) or a multipart body with ``sdp``
and ``session`` (JSON) parts → ``201`` with the answer SDP and ``Location: /v1/realtime/calls/{id}``;
``POST /v1/realtime/calls/{id}/hangup`` or ``DELETE /v1/realtime/calls/{id}`` ends the call.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.datastructures import FormData
from starlette.types import Message

from duplex.api.auth import app_state, request_secret, require_key
from duplex.api.ephemeral_keys import apply_secret_session
from duplex.api.errors import ERROR_RESPONSES, MAX_BODY_BYTES, APIError, read_body, require_pipeline
from duplex.protocol.session_update import apply_session_update
from duplex.registry import TooManySessions
from duplex.transports.webrtc.call import WebRTCCall
from duplex.transports.webrtc.sdp import SdpError

log = logging.getLogger(__name__)
router = APIRouter(dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)

# The offer is read and parsed by hand (size caps while streaming, SDP checks); this declares it for
# the OpenAPI document.
OFFER_BODY = {"required": True, "content": {
    "application/sdp": {"schema": {"type": "string"}},
    "multipart/form-data": {"schema": {"type": "object", "required": ["sdp"], "properties": {
        "sdp": {"type": "string"},
        "session": {"type": "string", "description": "a session configuration (JSON)"}}}},
}}


class SdpResponse(Response):
    media_type = "application/sdp"


async def _offer(request: Request) -> tuple[str, dict[str, Any] | None]:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/sdp":
        body = await read_body(request)
        try:
            return body.decode("utf-8"), None
        except UnicodeDecodeError:
            raise APIError(400, "the SDP offer is not UTF-8 text", "invalid_sdp") from None
    if kind == "multipart/form-data":
        form = await _capped_form(request)
        sdp = form.get("sdp")
        if sdp is None:
            raise APIError(400, "the multipart body has no 'sdp' part", "missing_sdp", param="sdp")
        sdp_text = sdp if isinstance(sdp, str) else (await sdp.read()).decode("utf-8", "replace")
        raw_session = form.get("session")
        session = None
        if raw_session is not None:
            text = raw_session if isinstance(raw_session, str) else (await raw_session.read()).decode()
            try:
                session = json.loads(text)
            except ValueError:
                raise APIError(400, "the 'session' part is not JSON", "invalid_session", param="session") from None
        return sdp_text, session
    raise APIError(415, f"unsupported content type {kind or '(none)'!r}: send application/sdp "
                   "or multipart/form-data with 'sdp' and 'session' parts", "unsupported_content_type")


async def _capped_form(request: Request) -> FormData:
    """The multipart form, read with the body cap enforced while it streams (a chunked body
    declares no length) and at most the two parts the flow has, each capped too."""
    body = await read_body(request)

    async def replay() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    return await Request(request.scope, replay).form(max_files=2, max_fields=2,
                                                     max_part_size=MAX_BODY_BYTES)


@router.post("/v1/realtime/calls", status_code=201, response_class=SdpResponse,
             openapi_extra={"requestBody": OFFER_BODY})
async def create_call(request: Request) -> Response:
    state = app_state(request)
    pipeline = require_pipeline(state)
    sdp, session = await _offer(request)
    call = WebRTCCall(state.settings, state.policy, pipeline, state.registry, state.settings.preset)
    secret = request_secret(request)
    if secret is not None and secret.session is not None:
        apply_secret_session(call.session, secret.session)
    if session is not None:
        if not isinstance(session, dict):
            raise APIError(400, "the 'session' part must be a JSON object", "invalid_session", param="session")
        voices = [*call.session.voices, *call.session.defaults.voice_map]
        config, errors = apply_session_update(call.session.config, session, voices,
                                              call.session.defaults.mcp_servers)
        if errors:  # no event channel yet to report them on: the offer is refused
            raise APIError(400, errors[0].message, errors[0].code, param=errors[0].param)
        call.session.reconfigure(config)
    try:
        answer = await call.start(sdp)
    except TooManySessions as err:
        await call.peer.close("refused")
        raise APIError(503, str(err), "too_many_sessions", kind="server_error",
                       headers={"Retry-After": str(err.retry_after_s)}) from None
    except SdpError as err:
        raise APIError(400, str(err), "invalid_sdp", param="sdp") from None
    log.info("call %s started", call.id)
    return SdpResponse(answer, status_code=201,
                       headers={"Location": f"/v1/realtime/calls/{call.id}"})


async def _hangup(request: Request, call_id: str) -> Response:
    slot = app_state(request).registry.get(call_id)
    if slot is None or slot.transport != "webrtc":
        raise APIError(404, f"no call {call_id!r}", "call_not_found", kind="not_found_error")
    await slot.close()
    return Response(status_code=200)


@router.post("/v1/realtime/calls/{call_id}/hangup", response_class=Response)
async def hangup(request: Request, call_id: str) -> Response:
    return await _hangup(request, call_id)


@router.delete("/v1/realtime/calls/{call_id}", response_class=Response)
async def delete_call(request: Request, call_id: str) -> Response:
    return await _hangup(request, call_id)
