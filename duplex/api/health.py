"""``/healthz`` (200 when the pipeline serves, 503 while it loads or after it broke) and ``/metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from duplex import metrics
from duplex.api.auth import app_state, require_key
from duplex.api.errors import ERROR_RESPONSES

router = APIRouter()


@router.get("/healthz", responses={503: {
    "description": "The pipeline is loading, or broke",
    "content": {"application/json": {"schema": {"type": "object", "required": ["status"]}}}}})
async def healthz(request: Request) -> JSONResponse:
    state = app_state(request)
    body = {"status": "ok", "preset": state.settings.preset}
    pipeline = state.pipeline
    if state.serving_pipeline() is None:
        error = state.pipeline_error or (pipeline.failure if pipeline is not None else None)
        body["status"] = "error" if error else "loading"
        if error:
            body["error"] = error
        return JSONResponse(body, status_code=503)
    return JSONResponse(body)


@router.get("/metrics", dependencies=[Depends(require_key)], response_class=PlainTextResponse,
            responses=ERROR_RESPONSES)
async def prometheus(request: Request) -> Response:
    state = app_state(request)
    metrics.OUTBOUND_QUEUE_SECONDS.set(state.registry.queued_seconds())
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
