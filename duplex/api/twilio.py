"""Twilio telephony (CONTRACT.md): ``POST /v1/telephony/twilio/voice`` answers Twilio's voice
webhook with TwiML that connects the call to ``GET /v1/telephony/twilio``, the Media Streams
WebSocket served by ``duplex.transports.twilio``.

Twilio cannot send an Authorization header: with ``--api-key`` both take the key as a ``token``
query parameter (the TwiML passes it on to the stream as a custom parameter; the stream also takes
it from the query). With ``--twilio-auth-token`` both also need Twilio's request signature
(``duplex.api.twilio_signature``): the webhook answers 403 without it, the stream closes with 1008.

A stream authenticates before it costs anything but its socket (DESIGN.md, invariant 10): its
signature in the handshake, then its token in the ``start`` message, which must come within
``START_TIMEOUT_S`` (else 1008). Only then are its Session and registry slot made: a stream refused
for the limit or an unready pipeline is closed with 1013, a bad signature, token or protocol with
1008, before any audio.
"""

from __future__ import annotations

import logging
from xml.sax.saxutils import quoteattr

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response

from duplex.api.auth import app_state, token_ok
from duplex.api.errors import ERROR_RESPONSES, APIError
from duplex.api.twilio_signature import SIGNATURE_HEADER, public_origin, public_url, signature_ok
from duplex.app_state import AppState
from duplex.registry import TooManySessions
from duplex.transports.twilio import (
    CLOSE_POLICY_VIOLATION,
    TwilioConnection,
    TwilioStreamError,
    receive_start,
)

log = logging.getLogger(__name__)
router = APIRouter()

STREAM_PATH = "/v1/telephony/twilio"
CLOSE_TRY_AGAIN_LATER = 1013


class TwimlResponse(Response):
    media_type = "application/xml"


@router.post(f"{STREAM_PATH}/voice", response_class=TwimlResponse, responses=ERROR_RESPONSES)
async def voice(request: Request, token: str | None = None) -> Response:
    settings = app_state(request).settings
    if settings.twilio_auth_token is not None:
        form = await request.form()
        params = [(name, value) for name, value in form.multi_items() if isinstance(value, str)]
        if not signature_ok(settings.twilio_auth_token, public_url(request), params,
                            request.headers.get(SIGNATURE_HEADER)):
            log.info("twilio voice webhook refused: missing or invalid X-Twilio-Signature")
            raise APIError(403, f"missing or invalid {SIGNATURE_HEADER}", "invalid_signature",
                           kind="authentication_error")
    if not token_ok(settings.api_key, token):
        raise APIError(401, "missing or invalid token (?token=KEY)", "invalid_api_key",
                       kind="authentication_error")
    url = public_origin(request, websocket=True) + STREAM_PATH
    parameter = f'<Parameter name="token" value={quoteattr(token)}/>' if token else ""
    twiml = (f'<?xml version="1.0" encoding="UTF-8"?><Response><Connect>'
             f"<Stream url={quoteattr(url)}>{parameter}</Stream></Connect></Response>")
    return TwimlResponse(twiml)


@router.websocket(STREAM_PATH)
async def media_stream(websocket: WebSocket, token: str | None = None) -> None:
    state: AppState = websocket.app.state.duplex
    settings = state.settings
    await websocket.accept()
    auth_token = settings.twilio_auth_token
    if auth_token is not None and not signature_ok(auth_token, public_url(websocket), (),
                                                   websocket.headers.get(SIGNATURE_HEADER)):
        log.info("twilio stream refused: missing or invalid X-Twilio-Signature")
        await websocket.close(CLOSE_POLICY_VIOLATION, f"missing or invalid {SIGNATURE_HEADER}")
        return
    try:
        start = await receive_start(websocket)
    except TwilioStreamError as err:
        log.info("twilio stream refused before 'start': %.200s", err)
        await websocket.close(CLOSE_POLICY_VIOLATION, str(err)[:120])
        return
    if start is None:
        return  # the client left before 'start'
    if not token_ok(settings.api_key, token, start.token):
        log.info("twilio stream %.64s refused: missing or invalid token", start.stream_sid)
        await websocket.close(CLOSE_POLICY_VIOLATION, "missing or invalid token")
        return
    pipeline = state.serving_pipeline()
    if pipeline is None:
        await websocket.close(CLOSE_TRY_AGAIN_LATER, "the model pipeline is not ready")
        return
    try:
        state.registry.check_room()  # before a Session is built; nothing awaits until admit()
    except TooManySessions as err:
        await websocket.close(CLOSE_TRY_AGAIN_LATER, str(err)[:120])
        return
    connection = TwilioConnection(websocket, settings, pipeline, state.registry, settings.preset,
                                  start)
    connection.admit()
    await connection.run()
