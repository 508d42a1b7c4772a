"""Calls as OpenAI's Realtime API has them (CONTRACT.md, docs/operators.md):

``POST /v1/realtime/calls`` with an SDP offer (``application/sdp``) or a multipart body with ``sdp``
and ``session`` (JSON) parts → ``201`` with the answer SDP and ``Location: /v1/realtime/calls/{id}``;
the same path with a JSON body ``{"target_uri": "sip:…", "session": {…}}`` places a SIP call
(transports/sip/dial.py) → ``201`` with the call (its id and state), which
``GET /v1/realtime/calls/{id}`` reports as it goes;
``POST /v1/realtime/calls/{id}/hangup`` or ``DELETE /v1/realtime/calls/{id}`` ends a WebRTC or SIP
call. A SIP call that rings while the ``--call-webhook`` app decides (transports/sip/ringing.py) is
answered with ``POST /v1/realtime/calls/{id}/accept`` (a session config: the fields of
``session.update``) or refused with ``POST /v1/realtime/calls/{id}/reject`` (``status_code``).

A WebRTC call whose peer connection was lost without a hang-up is resumed (docs/resume.md) by a new
offer that presents its last ``session.created``'s ``session.resume_token``, as the ``resume_token``
part of the multipart body or the ``resume_token`` query parameter, with the same API key or client
secret as the call's first offer: ``201`` with the answer and the same ``Location``, and the
session goes on through the new peer. A token that is unknown, used, expired or another
credential's gets ``400`` ``invalid_resume_token``; no session is made. WebRTC calls and WebSocket
sessions keep their tokens apart (``AppState.call_resumes`` beside ``resumes``): a token resumes
only a session of the transport it was issued on.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from duplex.api.auth import app_state, request_credential, request_secret, require_key
from duplex.api.call_offers import Offer, read_offer
from duplex.api.ephemeral_keys import apply_secret_session
from duplex.api.errors import ERROR_RESPONSES, APIError, read_body, require_pipeline
from duplex.protocol.session_update import apply_session_update
from duplex.registry import TooManySessions
from duplex.session.config import SessionConfig
from duplex.session.resume import ResumeRefused
from duplex.settings import SessionDefaults
from duplex.transports.sip.agent import SipAgent
from duplex.transports.sip.dial import TargetNotAllowed
from duplex.transports.sip.handler import CallRefused, InvalidTarget, ReferError
from duplex.transports.sip.ringing import (
    DECLINE,
    AlreadyDecided,
    CallGone,
    RingingCall,
    RingingCalls,
)
from duplex.transports.webrtc.call import WebRTCCall
from duplex.transports.webrtc.sdp import SdpError, plan_answer

log = logging.getLogger(__name__)
router = APIRouter(dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)


class DialRequest(BaseModel):
    """A call to place (the JSON body of ``POST /v1/realtime/calls``)."""

    model_config = ConfigDict(extra="forbid")

    target_uri: str = Field(max_length=1024, description="who is called: sip:user@IP[:port], an "
                            "address the SIP allow-list (--sip-allow) lets in")
    session: dict[str, Any] | None = Field(
        default=None, description="the session config once the callee answers: the fields of "
        "session.update, as /accept takes them")
    ring_timeout_s: float = Field(default=30.0, gt=0, le=300,
                                  description="seconds to ring before giving up (CANCEL)")


# A placed call as the API reports it (transports/sip/outbound.py, DialledCall.as_json).
CALL_SCHEMA = {"type": "object", "required": ["id", "object", "direction", "target_uri", "state"],
               "properties": {
                   "id": {"type": "string"}, "object": {"type": "string"},
                   "direction": {"type": "string"}, "target_uri": {"type": "string"},
                   "state": {"type": "string", "enum": ["dialing", "ringing", "active", "ended",
                                                        "failed", "cancelled", "no_answer"]},
                   "sip_status": {"type": ["integer", "null"]}, "reason": {"type": ["string", "null"]},
                   "created_at": {"type": "integer"}}}

# The offer is read and parsed by hand (size caps while streaming, SDP checks); this declares it for
# the OpenAPI document.
OFFER_BODY = {"required": True, "content": {
    "application/sdp": {"schema": {"type": "string"}},
    "multipart/form-data": {"schema": {"type": "object", "required": ["sdp"], "properties": {
        "sdp": {"type": "string"},
        "session": {"type": "string", "description": "a session configuration (JSON)"},
        "resume_token": {"type": "string", "description": "resume the call whose session.created "
                         "carried this token (docs/resume.md)"}}}},
    "application/json": {"schema": DialRequest.model_json_schema()},
}}

RESUME_TOKEN_PARAMETER = {"name": "resume_token", "in": "query", "required": False,
                          "schema": {"type": "string"}, "description": "resume the call whose "
                          "session.created carried this token (docs/resume.md)"}


class SdpResponse(Response):
    media_type = "application/sdp"


@router.post("/v1/realtime/calls", status_code=201, response_class=SdpResponse,
             openapi_extra={"requestBody": OFFER_BODY, "parameters": [RESUME_TOKEN_PARAMETER]},
             responses={201: {
                 "description": "the SDP answer of a WebRTC call, or a placed SIP call (JSON)",
                 "content": {"application/json": {"schema": CALL_SCHEMA}}}})
async def create_call(request: Request) -> Response:
    state = app_state(request)
    pipeline = require_pipeline(state)
    if request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json":
        return await _dial(request)
    offer = await read_offer(request)
    if offer.resume_token is not None:
        return await _resume(request, offer)
    call = WebRTCCall(state.settings, state.policy, pipeline, state.registry, state.settings.preset,
                      state.call_resumes)
    secret = request_secret(request)
    if secret is not None and secret.session is not None:
        apply_secret_session(call.session, secret.session)
    if offer.session is not None:
        call.session.reconfigure(_configured(call.session.config, offer.session,
                                             call.session.voices, call.session.defaults))
    try:
        answer = await call.start(offer.sdp, request_credential(request))
    except TooManySessions as err:
        await call.peer.close("refused")
        raise APIError(503, str(err), "too_many_sessions", kind="server_error",
                       headers={"Retry-After": str(err.retry_after_s)}) from None
    except SdpError as err:
        raise APIError(400, str(err), "invalid_sdp", param="sdp") from None
    log.info("call %s started", call.id)
    return SdpResponse(answer, status_code=201,
                       headers={"Location": f"/v1/realtime/calls/{call.id}"})


async def _resume(request: Request, offer: Offer) -> Response:
    """Resume the call ``offer.resume_token`` names through a new peer (module doc). Nothing is
    used up by a request refused before the token is looked at (a bad offer, a session part)."""
    if offer.session is not None:
        raise APIError(400, "a resumed call keeps its session config: send session.update on the "
                       "events channel instead of a 'session' part", "invalid_session",
                       param="session")
    try:
        plan_answer(offer.sdp, video=True)  # a bad offer costs no token
    except SdpError as err:
        raise APIError(400, str(err), "invalid_sdp", param="sdp") from None
    answer: str | None = None
    try:
        call = app_state(request).call_resumes.take(offer.resume_token or "", request_credential(request))
        assert isinstance(call, WebRTCCall)
        try:
            answer = await call.resume(offer.sdp)
        except SdpError as err:
            raise APIError(400, str(err), "invalid_sdp", param="sdp") from None
        reason = f"session {call.id} ended while it was being resumed"
    except ResumeRefused as err:
        reason = str(err)
    if answer is None:
        log.info("call resume refused: %s", reason)
        raise APIError(400, "the resume token is unknown, already used, expired or another key's",
                       "invalid_resume_token", param="resume_token")
    log.info("call %s resumed", call.id)
    return SdpResponse(answer, status_code=201,
                       headers={"Location": f"/v1/realtime/calls/{call.id}"})


async def _dial(request: Request) -> Response:
    """Place a SIP call (module doc); nothing is sent for a request refused here."""
    try:
        dial = DialRequest.model_validate_json(await read_body(request))
    except ValidationError as err:
        raise RequestValidationError(err.errors()) from None
    agent = _agent(request)
    if agent is None:
        raise APIError(400, "dialling out needs the SIP server (--sip-port)", "sip_disabled")
    settings = app_state(request).settings
    config = _configured(settings.session.session_config("sip"), dial.session or {},
                         settings.voices, settings.session)
    try:
        call = await agent.dial(dial.target_uri, config, dial.ring_timeout_s)
    except TargetNotAllowed as err:
        raise APIError(400, str(err), "target_not_allowed", param="target_uri") from None
    except InvalidTarget as err:
        raise APIError(400, str(err), "invalid_target_uri", param="target_uri") from None
    except CallRefused as err:  # no room, the pipeline restarting, no RTP port
        raise APIError(503, f"the call cannot be placed now: {err.reason}", "too_many_sessions",
                       kind="server_error", headers={"Retry-After": str(err.retry_after or 5)}) from None
    log.info("call %s placed to %s", call.id, dial.target_uri)
    return JSONResponse(call.as_json(), status_code=201,
                        headers={"Location": f"/v1/realtime/calls/{call.id}"})


def _agent(request: Request) -> SipAgent | None:
    """The SIP agent while the SIP server runs (serve.py)."""
    return getattr(request.app.state, "sip_agent", None)


@router.get("/v1/realtime/calls/{call_id}", responses={200: {
    "description": "a call the server placed", "content": {"application/json": {"schema": CALL_SCHEMA}}}})
async def get_call(request: Request, call_id: str) -> JSONResponse:
    """A call the server placed: its state (transports/sip/outbound.py)."""
    agent = _agent(request)
    call = agent.outbound.get(call_id) if agent is not None else None
    if call is None:
        raise _not_found(call_id)
    return JSONResponse(call.as_json())


def _configured(base: SessionConfig, session: Any, voices: list[str],
               defaults: SessionDefaults) -> SessionConfig:
    """``base`` with a call's session config applied, as ``session.update`` applies it. There is
    no event channel yet to report a bad field on: the request is refused (400) with the first."""
    if not isinstance(session, dict):
        raise APIError(400, "the session config must be a JSON object", "invalid_session", param="session")
    config, errors = apply_session_update(base, session, [*voices, *defaults.voice_map],
                                          defaults.mcp_servers)
    if errors:
        raise APIError(400, errors[0].message, errors[0].code, param=errors[0].param)
    return config


def _not_found(call_id: str) -> APIError:
    return APIError(404, f"no call {call_id!r}", "call_not_found", kind="not_found_error")


def _ringing_now(request: Request, call_id: str) -> RingingCall | None:
    """The SIP call ``call_id`` if it rings while the app decides (serve.py keeps the table)."""
    calls: RingingCalls | None = getattr(request.app.state, "ringing_calls", None)
    return calls.get(call_id) if calls is not None else None


def _ringing(request: Request, call_id: str) -> RingingCall:
    """The SIP call ``call_id`` that rings while the app decides; 409 once it was answered."""
    call = _ringing_now(request, call_id)
    if call is not None:
        return call
    slot = app_state(request).registry.get(call_id)
    if slot is not None and slot.transport == "sip":
        raise APIError(409, f"call {call_id!r} was accepted already", "call_already_accepted")
    raise _not_found(call_id)


@router.post("/v1/realtime/calls/{call_id}/accept", response_class=Response)
async def accept_call(request: Request, call_id: str,
                      session: Annotated[dict[str, Any] | None, Body()] = None) -> Response:
    state = app_state(request)
    call = _ringing(request, call_id)
    settings = state.settings
    config = _configured(settings.session.session_config(), session or {}, settings.voices,
                         settings.session)
    try:
        await call.accept(config)
    except AlreadyDecided as err:
        raise APIError(409, str(err), "call_already_decided") from None
    except CallGone:
        raise _not_found(call_id) from None
    except CallRefused as err:  # no room after all, or the pipeline restarts
        raise APIError(503, f"the call could not be answered: {err}", "too_many_sessions",
                       kind="server_error", headers={"Retry-After": str(err.retry_after or 5)}) from None
    log.info("call %s accepted", call_id)
    return Response(status_code=200)


class RejectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status_code: int = Field(default=DECLINE, ge=400, le=699,
                             description="the SIP status the caller gets (603 Decline by default)")


@router.post("/v1/realtime/calls/{call_id}/reject", response_class=Response)
async def reject_call(request: Request, call_id: str, body: RejectRequest | None = None) -> Response:
    call = _ringing(request, call_id)
    try:
        call.reject((body or RejectRequest()).status_code)
    except AlreadyDecided as err:
        raise APIError(409, str(err), "call_already_decided") from None
    return Response(status_code=200)


class ReferRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target_uri: str = Field(max_length=1024, description="where the caller is sent: a sip:, sips: or tel: URI")


@router.post("/v1/realtime/calls/{call_id}/refer", response_class=Response)
async def refer_call(request: Request, call_id: str, body: ReferRequest) -> Response:
    """Transfer a live SIP call: a REFER to the caller; its progress comes as server events."""
    agent = _agent(request)
    call = agent.live.get(call_id) if agent is not None else None
    if call is None:
        if app_state(request).registry.get(call_id) is not None or _ringing_now(request, call_id):
            raise APIError(409, f"call {call_id!r} is not an answered SIP call: only those can be "
                           "transferred", "call_not_transferable")
        raise _not_found(call_id)
    try:
        call.refer(body.target_uri)
    except InvalidTarget as err:
        raise APIError(400, str(err), "invalid_target_uri", param="target_uri") from None
    except ReferError as err:
        raise APIError(409, str(err), "call_not_transferable") from None
    return Response(status_code=200)


async def _hangup(request: Request, call_id: str) -> Response:
    """End a live WebRTC or SIP call; a SIP call still ringing is declined (603), one we place
    that still rings is given up (CANCEL)."""
    agent = _agent(request)
    placed = agent.outbound.get(call_id) if agent is not None else None
    if placed is not None and placed.dialling is not None:
        placed.dialling.cancel()
        return Response(status_code=200)
    ringing = _ringing_now(request, call_id)
    if ringing is not None:
        try:
            ringing.reject(DECLINE)
        except AlreadyDecided:
            pass  # accepted a moment ago: it is about to be live, and is hung up there
        else:
            return Response(status_code=200)
    slot = app_state(request).registry.get(call_id)
    if slot is None or slot.transport not in ("webrtc", "sip"):
        raise _not_found(call_id)
    await slot.close()
    return Response(status_code=200)


@router.post("/v1/realtime/calls/{call_id}/hangup", response_class=Response)
async def hangup(request: Request, call_id: str) -> Response:
    return await _hangup(request, call_id)


@router.delete("/v1/realtime/calls/{call_id}", response_class=Response)
async def delete_call(request: Request, call_id: str) -> Response:
    return await _hangup(request, call_id)
