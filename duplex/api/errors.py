"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from duplex.app_state import AppState
from pipeline.coordinator import Coordinator

MAX_BODY_BYTES = 25 * 1024 * 1024


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.kind = kind
        self.headers = headers


# The OpenAPI declaration of a route's errors: any 4xx or 5xx, always this body (``error_body``:
# HANDLERS and the origin guard answer every error so), JSON whatever the route's own media type.
# The ranges also take the place of FastAPI's default ``422`` entry, a status this API never sends:
# its validation errors are 400s.
ERROR_SCHEMA: dict[str, Any] = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": description, "content": {"application/json": {"schema": ERROR_SCHEMA}}}
    for status, description in [
        ("4XX", "An OpenAI-style error"),
        ("5XX", "An OpenAI-style error (with Retry-After when it may pass: not ready, overloaded)")]
}


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.kind, err.code, err.param), status_code=err.status,
                        headers=err.headers)


async def _api_error(request: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, APIError)
    return error_response(err)


async def _http_error(request: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, StarletteHTTPException)
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(err.detail), kind, None), status_code=err.status_code,
                        headers=getattr(err, "headers", None))


async def _validation_error(request: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, RequestValidationError)
    first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(p) for p in first["loc"] if p != "body") or None
    return JSONResponse(error_body(f"{param}: {first['msg']}" if param else first["msg"],
                                   "invalid_request_error", "invalid_value", param), status_code=400)


HANDLERS = {
    APIError: _api_error,
    StarletteHTTPException: _http_error,
    RequestValidationError: _validation_error,
}


def require_pipeline(state: AppState) -> Coordinator:
    """The serving pipeline, or a 503 with Retry-After for an HTTP endpoint."""
    pipeline = state.serving_pipeline()
    if pipeline is None:
        raise APIError(503, "the model pipeline is not ready", "pipeline_unavailable",
                       kind="server_error", headers={"Retry-After": "5"})
    return pipeline


async def read_body(request: Request) -> bytes:
    """The request body, refused with 413 beyond MAX_BODY_BYTES without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes", "request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes", "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)
