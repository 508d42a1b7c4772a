"""Twilio telephony (CONTRACT.md): ``POST /v1/telephony/twilio/voice`` answers Twilio's voice
webhook with TwiML that connects the call to ``GET /v1/telephony/twilio``, the Media Streams
WebSocket served by ``duplex.transports.twilio``.

Twilio cannot send an Authorization header: with ``--api-key`` both take the key as a ``token``
query parameter (the TwiML passes it on to the stream as a custom parameter). A stream refused for
the limit or an unready pipeline is closed with 1013, a bad key with 1008, before any audio.
"""

from __future__ import annotations

import hmac
import logging
from xml.sax.saxutils import quoteattr

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response

from duplex.api.auth import app_state
from duplex.api.errors import ERROR_RESPONSES, APIError
from duplex.app_state import AppState
from duplex.registry import TooManySessions
from duplex.transports.twilio import TwilioConnection

log = logging.getLogger(__name__)
router = APIRouter()

STREAM_PATH = "/v1/telephony/twilio"
CLOSE_TRY_AGAIN_LATER = 1013


class TwimlResponse(Response):
    media_type = "application/xml"


def _token_ok(key: str | None, token: str | None) -> bool:
    return key is None or (token is not None and hmac.compare_digest(token.encode(), key.encode()))


@router.post(f"{STREAM_PATH}/voice", response_class=TwimlResponse, responses=ERROR_RESPONSES)
async def voice(request: Request, token: str | None = None) -> Response:
    key = app_state(request).settings.api_key
    if not _token_ok(key, token):
        raise APIError(401, "missing or invalid token (?token=KEY)", "invalid_api_key",
                       kind="authentication_error")
    forwarded = request.headers.get("x-forwarded-proto", request.url.scheme)
    scheme = "wss" if forwarded in ("https", "wss") else "ws"
    url = f"{scheme}://{request.headers.get('host', request.url.netloc)}{STREAM_PATH}"
    parameter = f'<Parameter name="token" value={quoteattr(token)}/>' if token else ""
    twiml = (f'<?xml version="1.0" encoding="UTF-8"?><Response><Connect>'
             f"<Stream url={quoteattr(url)}>{parameter}</Stream></Connect></Response>")
    return TwimlResponse(twiml)


@router.websocket(STREAM_PATH)
async def media_stream(websocket: WebSocket, token: str | None = None) -> None:
    state: AppState = websocket.app.state.duplex
    await websocket.accept()
    pipeline = state.serving_pipeline()
    if pipeline is None:
        await websocket.close(CLOSE_TRY_AGAIN_LATER, "the model pipeline is not ready")
        return
    settings = state.settings
    connection = TwilioConnection(websocket, settings, pipeline, state.registry, settings.preset,
                                  settings.api_key)
    try:
        connection.admit()
    except TooManySessions as err:
        await websocket.close(CLOSE_TRY_AGAIN_LATER, str(err)[:120])
        return
    await connection.run(token)
