"""``GET /v1/realtime``: the OpenAI Realtime protocol over a WebSocket (CONTRACT.md).

A client address opening new sessions faster than ``AppState.new_sessions`` allows (20 at once,
then 2 a second, and none for ``PENALTY_S`` after one of its sessions was closed for breaking a
rule) is refused in the handshake: HTTP 429 with ``Retry-After: 1``, so that a client that
reconnects in a loop (as a flooder closed with 1008 does) costs the server one HTTP request each
time, and never gets to send a frame. Otherwise the handshake is accepted (answering the
``realtime`` subprotocol when the client offered OpenAI's) so that a refusal can carry a close code
the client sees, before any event:

- a missing or wrong API key → close 1008;
- the pipeline still loading, or the server at ``max_sessions`` → an ``error`` event, then close
  1013 (try again later).

Otherwise the connection becomes a WebSocketConnection until the client leaves. The ``model`` query
parameter (OpenAI's SDKs always send one) is accepted whatever it names and echoed as
``session.model``; the preset decides which model answers. Messages larger than 16 MiB are refused
by uvicorn itself (``ws_max_size`` in serve.py), which closes with 1009.

With a ``call_id`` query parameter the socket is the sideband of that live SIP call (incoming or
placed: duplex/transports/sip/sideband.py), after the same key check: the call's events and the
app's client events. A call the server is placing is waited for: the sideband attaches when it is
answered. An unknown call (``call_not_found``), a placed call that was not answered
(``call_not_answered``, with its state and SIP status), or one with a sideband attached already
(``sideband_in_use``) gets an ``error`` event, then close 1008. The call does not end with its
sideband.

A client whose connection dropped resumes its session (docs/resume.md) with the ``resume_token``
query parameter, its last ``session.created``'s ``session.resume_token``, and the same key or
client secret as before: the session goes on over the new socket (it keeps its slot: no room is
needed). A token that is unknown, used, expired or another key's gets an ``error`` event
(``invalid_resume_token``), then close 1008; no session is made.
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, WebSocket
from fastapi.responses import PlainTextResponse

from duplex.api.auth import (
    websocket_credential,
    websocket_key_ok,
    websocket_secret,
    websocket_subprotocol,
)
from duplex.api.ephemeral_keys import apply_secret_session
from duplex.app_state import AppState
from duplex.client_address import limit_key
from duplex.protocol.events import error_event
from duplex.registry import TooManySessions
from duplex.session.resume import ResumeRefused, ResumeStore
from duplex.transports.sip.sideband import Sideband, SidebandInUse
from duplex.transports.websocket import WebSocketConnection

log = logging.getLogger(__name__)
router = APIRouter()

CLOSE_POLICY_VIOLATION = 1008
CLOSE_TRY_AGAIN_LATER = 1013
TOO_MANY_REQUESTS = 429
# A client address whose session was closed for breaking a rule gets no new one for this long.
PENALTY_S = 5.0


async def _refuse(websocket: WebSocket, message: str, code: str) -> None:
    await websocket.send_text(json.dumps(error_event(message, code, kind="server_error")))
    await websocket.close(CLOSE_TRY_AGAIN_LATER, message[:120])


async def _resume(websocket: WebSocket, store: ResumeStore, token: str) -> WebSocketConnection | None:
    """Serve the session ``token`` resumes over ``websocket``, or refuse (module doc)."""
    try:
        connection = store.take(token, websocket_credential(websocket))
        assert isinstance(connection, WebSocketConnection)
        if await connection.resume(websocket):
            return connection
        reason = f"session {connection.id} ended while it was being resumed"
    except ResumeRefused as err:
        reason = str(err)
    log.info("realtime websocket refused: %s", reason)
    message = "the resume token is unknown, already used, expired or another key's"
    await websocket.send_text(json.dumps(error_event(message, "invalid_resume_token", param="resume_token")))
    await websocket.close(CLOSE_POLICY_VIOLATION, "invalid resume token")
    return None


async def _open(websocket: WebSocket, state: AppState, store: ResumeStore, model: str | None,
                address: str) -> WebSocketConnection | None:
    """Serve a new session over ``websocket``, or refuse (module doc)."""
    pipeline = state.serving_pipeline()
    if pipeline is None:
        await _refuse(websocket, "the model pipeline is not ready", "pipeline_unavailable")
        return None
    try:
        # Nothing awaits from here to admit(): the room checked is the room taken, and a refused
        # client costs no Session (VAD state, buffers) left for the garbage collector.
        state.registry.check_room()
    except TooManySessions as err:
        await _refuse(websocket, str(err), "too_many_sessions")
        return None
    connection = WebSocketConnection(websocket, state.settings, pipeline, state.registry,
                                     model or state.settings.preset,
                                     state.client_events.bucket(address), store)
    secret = websocket_secret(websocket)
    if secret is not None and secret.session is not None:
        apply_secret_session(connection.session, secret.session)
    connection.admit(websocket_credential(websocket))
    await connection.run()
    return connection


async def _sideband(websocket: WebSocket, call_id: str) -> None:
    """Serve the sideband of the live SIP call ``call_id``, or refuse (module doc)."""
    agent = getattr(websocket.app.state, "sip_agent", None)
    placing = agent.outbound.get(call_id) if agent is not None else None
    if placing is not None:
        await placing.placed.wait()  # a call being placed: attach once it is answered
    call = agent.live.get(call_id) if agent is not None else None
    if placing is not None and call is None and placing.state != "ended":
        message = (f"the call {call_id!r} was not answered: {placing.state} "
                   f"({placing.sip_status} {placing.reason})")
        code, reason = "call_not_answered", f"call {placing.state}"
    elif call is None:
        message = f"no live SIP call {call_id[:80]!r}: a sideband attaches to an answered SIP call"
        code, reason = "call_not_found", "no such call"
    else:
        try:
            await Sideband(websocket, call).run()
            return
        except SidebandInUse as err:
            message, code, reason = f"{err}: one sideband per call", "sideband_in_use", "sideband in use"
    log.info("sideband refused: %s", message)
    await websocket.send_text(json.dumps(error_event(message, code, param="call_id")))
    await websocket.close(CLOSE_POLICY_VIOLATION, reason)


@router.websocket("/v1/realtime")
async def realtime(websocket: WebSocket, model: str | None = None) -> None:
    state: AppState = websocket.app.state.duplex
    address = limit_key(websocket.client)
    if not state.new_sessions.take(address):
        log.warning("realtime websocket refused: too many new sessions from %s", address)
        await websocket.send_denial_response(PlainTextResponse(
            "too many new sessions from this address: try again in a second",
            status_code=TOO_MANY_REQUESTS, headers={"Retry-After": "1"}))
        return
    await websocket.accept(subprotocol=websocket_subprotocol(websocket))
    if not websocket_key_ok(websocket, state.settings.api_key):
        log.info("realtime websocket refused: missing or invalid API key")
        await websocket.close(CLOSE_POLICY_VIOLATION, "missing or invalid API key")
        return
    call_id = websocket.query_params.get("call_id")
    if call_id is not None:
        await _sideband(websocket, call_id)
        return
    store = state.resumes
    token = websocket.query_params.get("resume_token")
    if token is not None:
        connection = await _resume(websocket, store, token)
    else:
        connection = await _open(websocket, state, store, model, address)
    if connection is not None and connection.closing is not None and connection.closing.clients_fault:
        # Closed for breaking a rule (flooding, garbage): no new session for a while.
        state.new_sessions.bucket(address).penalize(PENALTY_S)
