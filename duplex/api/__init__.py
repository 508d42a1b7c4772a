"""HTTP and WebSocket endpoints. Each module exposes ``router``; ``routers()`` lists them all."""

from __future__ import annotations

from fastapi import APIRouter


def routers() -> list[APIRouter]:
    from duplex.api import (
        chat_completions,
        client_secrets,
        health,
        ice_servers,
        models,
        realtime_calls,
        realtime_ws,
        twilio,
    )

    return [health.router, realtime_calls.router, realtime_ws.router, chat_completions.router,
            twilio.router, models.router, client_secrets.router, ice_servers.router]
