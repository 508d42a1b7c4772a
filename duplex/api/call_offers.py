"""What a WebRTC offer (``POST /v1/realtime/calls``, duplex/api/realtime_calls.py) carries, read
from the request: the SDP, the session config and the resume token (docs/resume.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.datastructures import FormData
from starlette.types import Message

from duplex.api.errors import MAX_BODY_BYTES, APIError, read_body


@dataclass(frozen=True)
class Offer:
    """What a WebRTC offer request carries (module doc)."""

    sdp: str
    session: Any = None  # the session config (parsed JSON), if given
    resume_token: str | None = None


async def read_offer(request: Request) -> Offer:
    """The offer of ``POST /v1/realtime/calls`` (an SDP body or a multipart form); APIError (400,
    415) for a body that holds none."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    query_token = request.query_params.get("resume_token")
    if kind == "application/sdp":
        body = await read_body(request)
        try:
            return Offer(body.decode("utf-8"), resume_token=query_token)
        except UnicodeDecodeError:
            raise APIError(400, "the SDP offer is not UTF-8 text", "invalid_sdp") from None
    if kind == "multipart/form-data":
        form = await _capped_form(request)
        if form.get("sdp") is None:
            raise APIError(400, "the multipart body has no 'sdp' part", "missing_sdp", param="sdp")
        sdp = await _part(form, "sdp")
        raw_session, token = await _part(form, "session"), await _part(form, "resume_token")
        session = None
        if raw_session is not None:
            try:
                session = json.loads(raw_session)
            except ValueError:
                raise APIError(400, "the 'session' part is not JSON", "invalid_session",
                               param="session") from None
        return Offer(sdp or "", session, token if token is not None else query_token)
    raise APIError(415, f"unsupported content type {kind or '(none)'!r}: send application/sdp "
                   "or multipart/form-data with 'sdp' and 'session' parts",
                   "unsupported_content_type")


async def _part(form: FormData, name: str) -> str | None:
    """A multipart part as text (a field, or a file part read whole), None where absent."""
    value = form.get(name)
    if value is None or isinstance(value, str):
        return value
    return (await value.read()).decode("utf-8", "replace")


async def _capped_form(request: Request) -> FormData:
    """The multipart form, read with the body cap enforced while it streams (a chunked body
    declares no length) and at most the three parts the flow has, each capped too."""
    body = await read_body(request)

    async def replay() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    return await Request(request.scope, replay).form(max_files=3, max_fields=3,
                                                     max_part_size=MAX_BODY_BYTES)

