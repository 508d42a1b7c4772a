"""The FastAPI app that ``python -m duplex.serve`` runs (:func:`create_app`): its routes, the web
page, its middleware and its lifespan, which starts the pipeline and the SIP server.

The app owns one AppState for its life: the pipeline (started in the background at start-up, so
``/healthz`` answers 503 while a model loads), the session registry and the ICE policy. Shutdown
ends every session, then stops the pipeline and its stage processes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from duplex.api import routers
from duplex.api.errors import HANDLERS
from duplex.api.realtime_ws import CLOSE_POLICY_VIOLATION
from duplex.app_state import AppState
from duplex.client_address import ProxyHeaders, TrustedProxies
from duplex.loop_lag import sample_lag
from duplex.origin_guard import AllowedHosts, OriginGuard
from duplex.registry import SessionRegistry
from duplex.session.resume import ResumeStore
from duplex.settings import Preset
from duplex.transports.sip.agent import SipAgent
from duplex.transports.sip.ringing import RingingCalls
from duplex.transports.sip.server import SipConfig, SipServer
from duplex.transports.sip.webhook import CallWebhook
from duplex.transports.webrtc.ice import IcePolicy
from pipeline.runner import start_pipeline

log = logging.getLogger(__name__)

WEB_CLIENT = Path(__file__).parent / "web_client"  # the repository's web_client/, linked (package data)
WS_MAX_BYTES = 16 * 1024 * 1024
# How long a WebSocket that broke a rule (closed with 1008: flooding, garbage, a wrong key) has to
# answer our close frame. Until then uvicorn reads and parses (and throws away) whatever the client
# sends, 10 s by its own timeout, which let a client closed for flooding that never reads keep the
# server parsing its garbage at full speed for 10 s after the close. A client that reads answers
# within a round trip; cutting it off at once instead would lose it the close frame (the socket
# closed on unread data resets), so that it saw 1006 rather than 1008 and the reason.
POLICY_CLOSE_TIMEOUT_S = 1.0


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's own WebSocket protocol (``websockets-sansio``, the one ``auto`` picks), which waits
    at most :data:`POLICY_CLOSE_TIMEOUT_S` for the answer to a close that is the client's fault
    (uvicorn has no setting for it; ``tests/api/test_event_flood.py`` checks it still works)."""

    async def send(self, message: Any) -> None:
        if message.get("type") == "websocket.close" and message.get("code") == CLOSE_POLICY_VIOLATION:
            self.close_timeout = POLICY_CLOSE_TIMEOUT_S
        await super().send(message)


async def _load_pipeline(state: AppState) -> None:
    settings = state.settings
    try:
        state.pipeline = await start_pipeline(state.preset.pipeline, mode=settings.pipeline_mode)
    except Exception as err:  # noqa: BLE001 - reported by /healthz and the log
        state.pipeline_error = str(err)
        log.error("the pipeline could not start: %s", err)
        return
    config = state.preset.pipeline
    devices = sorted({stage.device for stage in config.stages})
    scheme = "https" if settings.ssl_certfile else "http"
    log.info("preset %s ready: model %s, weights %s, devices %s", settings.preset, config.model,
             config.model_args or "(the model's own)", devices)
    print(f"duplex: ready — open {scheme}://{settings.host}:{settings.port}/ to talk to the agent",
          flush=True)


def _sip_server(app: FastAPI) -> SipServer | None:
    state: AppState = app.state.duplex
    settings = state.settings
    if settings.sip_port is None:
        return None
    agent = SipAgent(settings, state.registry, state.serving_pipeline, settings.preset,
                     app.state.ringing_calls)
    app.state.sip_agent = agent  # the call API's way to the live SIP calls (/refer)
    agent.server = SipServer(agent, SipConfig(
        host=settings.host, port=settings.sip_port, allow=settings.sip_allow,
        rtp_ports=settings.rtp_port_range, advertise=settings.sip_advertise,
        media_timeout=settings.session.inbound_media_timeout_s))
    return agent.server  # which also places the agent's calls (POST /v1/realtime/calls)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: AppState = app.state.duplex
    loader = asyncio.create_task(_load_pipeline(state))
    lag = asyncio.create_task(sample_lag())
    ringing: RingingCalls | None = app.state.ringing_calls
    sip = _sip_server(app)
    if sip is not None:
        await sip.start()
        log.info("SIP on udp %s:%d (peers allowed: %s)", state.settings.host, sip.port,
                 state.settings.sip_allow or "loopback only")
        if ringing is not None:
            log.info("incoming calls ring until %s decides (%.0f s at most)",
                     ringing.webhook.url, ringing.timeout_s)
    try:
        yield
    finally:
        if sip is not None:
            await sip.close()
        if ringing is not None:
            await ringing.webhook.close()
        await state.registry.close_all()
        loader.cancel()
        lag.cancel()
        await asyncio.gather(loader, lag, return_exceptions=True)
        if state.pipeline is not None:
            await state.pipeline.close()


def create_app(preset: Preset, policy: IcePolicy) -> FastAPI:
    """The app; ValueError for a malformed ``--forwarded-allow-ips``."""
    settings = preset.settings
    app = FastAPI(title="duplex", lifespan=_lifespan, exception_handlers=HANDLERS)
    app.state.duplex = AppState(preset, SessionRegistry(settings.max_sessions), policy,
                                resumes=ResumeStore(settings.session.resume_grace_s),
                                call_resumes=ResumeStore(settings.session.resume_grace_s))
    # SIP calls ringing while the --call-webhook app decides (the call API's accept/reject).
    app.state.ringing_calls = None
    app.state.sip_agent = None  # set while the SIP server runs
    if settings.call_webhook and settings.call_webhook_secret:
        app.state.ringing_calls = RingingCalls(
            CallWebhook(settings.call_webhook, settings.call_webhook_secret,
                        settings.call_decision_timeout_s),
            settings.call_decision_timeout_s)
    for router in routers():
        app.include_router(router)
    app.mount("/", StaticFiles(directory=WEB_CLIENT, html=True), name="web_client")
    app.add_middleware(OriginGuard, enabled=settings.api_key is None,
                       hosts=AllowedHosts(settings.host, settings.allowed_host))
    # Added last, so outermost: everything inside sees the client the trusted proxy names.
    app.add_middleware(ProxyHeaders, trusted=TrustedProxies(settings.forwarded_allow_ips))
    return app
