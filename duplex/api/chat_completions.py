"""``POST /v1/chat/completions``: OpenAI-compatible, with audio in and out (CONTRACT.md).

A completion is a request, not a session: it holds no slot in the session registry
(``--max-sessions`` counts conversations); what bounds completions is the pipeline's
``max_in_flight``, and a request beyond it gets 503 with ``Retry-After``.

Lifecycle of one completion, all owned by this handler and gone when it returns: validate the body
(400 naming the parameter, 413 beyond 25 MiB), decode input audio off the event loop, submit one
pipeline request, and wait for its first chunk. A failure before that is an HTTP error (500, or 503
when overloaded); from then on the answer is committed: non-streaming collects it into one JSON
message, streaming sends SSE chunks. A failure after the stream started sends
``data: {"error": {...}}`` and ends without ``data: [DONE]``. A client that disconnects at any
point aborts the pipeline request (the stream is closed, which aborts and waits for the stages'
acks).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import time
import uuid
import wave
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from duplex.api.auth import app_state, require_key
from duplex.api.chat_request import ChatRequest, model_messages, parse_request, request_schema
from duplex.api.errors import ERROR_RESPONSES, APIError, error_body, read_body, require_pipeline
from duplex.client_address import limit_key
from duplex.media.pcm import float_to_pcm16
from duplex.media.resample import Resampler
from duplex.protocol.wire_audio import PCM_RATE, OutboundEncoder
from pipeline.coordinator import PipelineError, PipelineOverloaded
from pipeline.proto import OmniRequest, OutputChunk

log = logging.getLogger(__name__)
JSON_ON_LOOP_BYTES = 256 << 10  # parsed inline below this (a thread hop costs more)
router = APIRouter(dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)

AUDIO_TTL_S = 3600  # OpenAI's audio.expires_at; this server keeps nothing, clients only read it
T = TypeVar("T")
_Stream = AsyncGenerator[OutputChunk, None]  # Coordinator.stream(): closing it aborts the request


class _ClientGone(Exception):
    """The client disconnected before the answer was committed."""


@dataclass
class _Completion:
    """One completion's identity and what the pipeline has produced for it so far."""

    request: ChatRequest
    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    audio_id: str = field(default_factory=lambda: f"audio_{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    audio_rate: int = PCM_RATE
    text_chunks: int = 0
    usage: dict[str, int] | None = None
    finish_reason: str = "stop"

    @property
    def request_id(self) -> str:
        return "req_" + self.id.removeprefix("chatcmpl-")

    def take(self, chunk: OutputChunk) -> tuple[str, np.ndarray | None]:
        """Record a pipeline chunk; returns its text delta and its audio (when audio is wanted)."""
        data = chunk.data
        text = data.get("text") or ""
        if "text" in data and not chunk.final:
            self.text_chunks += 1
        self.text.append(text)
        self.usage = data.get("usage") or self.usage
        self.finish_reason = data.get("finish_reason") or self.finish_reason
        audio = data.get("audio")
        if not self.request.speaks or audio is None or not len(audio):
            return text, None
        samples = np.asarray(audio, dtype=np.float32)
        self.audio_rate = int(data["sample_rate"])
        self.audio.append(samples)
        return text, samples

    def usage_object(self) -> dict[str, int]:
        # Models that report usage (qwen3_omni's thinker) give exact counts; otherwise the text
        # deltas stand in for completion tokens and the prompt is not counted.
        return self.usage or {"prompt_tokens": 0, "completion_tokens": self.text_chunks,
                              "total_tokens": self.text_chunks}

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [choice]}

    def message(self) -> dict[str, Any]:
        text = "".join(self.text)
        if not self.request.speaks:
            return {"role": "assistant", "content": text, "refusal": None}
        assert self.request.audio is not None
        samples = np.concatenate(self.audio) if self.audio else np.zeros(0, dtype=np.float32)
        data = _wav(samples, self.audio_rate) if self.request.audio.format == "wav" \
            else _pcm16(samples, self.audio_rate)
        return {"role": "assistant", "content": None, "refusal": None, "audio": {
            "id": self.audio_id, "data": base64.b64encode(data).decode("ascii"),
            "expires_at": self.created + AUDIO_TTL_S, "transcript": text}}

    def response(self) -> dict[str, Any]:
        choice = {"index": 0, "message": self.message(), "finish_reason": self.finish_reason,
                  "logprobs": None}
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": [choice], "usage": self.usage_object()}


def _wav(samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(float_to_pcm16(samples).astype("<i2").tobytes())
    return out.getvalue()


def _pcm16(samples: np.ndarray, rate: int) -> bytes:
    """Raw 24 kHz s16le, as OpenAI's pcm16 is."""
    if rate != PCM_RATE:
        resampler = Resampler(rate, PCM_RATE)
        samples = np.concatenate([resampler.push(samples), resampler.flush()])
    return float_to_pcm16(samples).astype("<i2").tobytes()


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``, cancelled (which aborts its pipeline request) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        # The body has been read: the next message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # on our own cancellation too: the stream's cleanup aborts the request
    if task in done:
        return task.result()
    with suppress(asyncio.CancelledError):
        await task
    raise _ClientGone


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ended, so that a client that went away
    while the body was suspended between chunks still aborts the pipeline request at once."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _events(completion: _Completion, first: OutputChunk | None, stream: _Stream,
                  audio_rate: int, log_: logging.LoggerAdapter) -> AsyncIterator[str]:
    speaks = completion.request.speaks
    audio_id = completion.audio_id
    encoder = OutboundEncoder("audio/pcm", audio_rate)
    try:
        yield _sse(completion.chunk({"role": "assistant", "content": None if speaks else ""}))
        chunk = first
        while chunk is not None:
            text, audio = completion.take(chunk)
            if text:
                delta = {"audio": {"id": audio_id, "transcript": text}} if speaks \
                    else {"content": text}
                yield _sse(completion.chunk(delta))
            if audio is not None:
                data, _ = encoder.encode(audio)
                yield _sse(completion.chunk({"audio": {"id": audio_id, "data": data}}))
            chunk = await anext(stream, None)
    except PipelineError as err:
        log_.warning("stream failed after it started: %s", err)
        yield _sse(error_body(str(err), "server_error", "pipeline_error"))
        return
    finally:
        await stream.aclose()
    # As OpenAI's: the last audio update carries only the audio's id and expiry.
    expires_at = completion.created + AUDIO_TTL_S
    last = {"audio": {"id": audio_id, "expires_at": expires_at}} if speaks else {}
    yield _sse(completion.chunk(last, completion.finish_reason))
    if completion.request.include_usage:
        yield _sse({**completion.chunk({}), "choices": [], "usage": completion.usage_object()})
    yield _sse("[DONE]")
    log_.info("streamed completion done")


async def _collect(completion: _Completion, first: OutputChunk | None, stream: _Stream) -> None:
    try:
        chunk = first
        while chunk is not None:
            completion.take(chunk)
            chunk = await anext(stream, None)
    finally:
        await stream.aclose()


def _overloaded(message: str) -> APIError:
    return APIError(503, message, "overloaded", kind="server_error", headers={"Retry-After": "1"})


# The body is read and validated by hand (size cap while streaming, parsing off the loop): the
# schema declares it for the OpenAPI document only.
@router.post("/v1/chat/completions", openapi_extra={"requestBody": {
    "required": True, "content": {"application/json": {"schema": request_schema()}}}})
async def chat_completions(request: Request) -> Response:
    state = app_state(request)
    pipeline = require_pipeline(state)
    body = await read_body(request)
    try:
        # Megabytes of JSON (base64 audio) take tens of ms to parse: not on the loop that paces
        # every call's audio.
        payload = json.loads(body) if len(body) < JSON_ON_LOOP_BYTES \
            else await asyncio.to_thread(json.loads, body)
    except (ValueError, RecursionError):
        raise APIError(400, "the request body is not valid JSON", "invalid_json") from None
    chat = parse_request(payload, state.settings.voices, pipeline.input_modalities)
    # Each client address is one owner of the pipeline's fair share (pipeline/admission.py): one
    # client's flood of completions fails that client, not a session's turn.
    owner = f"chat:{limit_key(request.client)}"
    try:
        # Refused before its audio is decoded: an overloaded server does no work for it.
        pipeline.check_admission(owner)
    except PipelineOverloaded as err:
        raise _overloaded(str(err)) from None
    max_audio_s = state.settings.session.max_input_audio_s
    messages = await asyncio.to_thread(model_messages, chat, max_audio_s)
    completion = _Completion(chat, chat.model or state.settings.preset)
    log_ = logging.LoggerAdapter(log, {"session_id": completion.id})
    params = {"modalities": ["text", "audio"] if chat.speaks else ["text"],
              "voice": chat.audio.voice if chat.audio else state.settings.session.voice,
              "max_output_tokens": chat.max_output_tokens}
    log_.info("completion: request %s, %d messages, stream=%s, modalities=%s",
              completion.request_id, len(messages), chat.stream, params["modalities"])
    omni = OmniRequest(completion.request_id, {"messages": messages}, params, owner=owner)
    stream: _Stream = pipeline.stream(omni)  # type: ignore[assignment]  # an async generator
    try:
        first = await _until_disconnect(request, anext(stream, None))
        if not chat.stream:
            await _until_disconnect(request, _collect(completion, first, stream))
            log_.info("completion done")
            return JSONResponse(completion.response())
    except PipelineOverloaded as err:
        raise _overloaded(str(err)) from None
    except PipelineError as err:
        raise APIError(500, str(err), "pipeline_error", kind="server_error") from None
    except _ClientGone:
        log_.info("client disconnected: request %s aborted", completion.request_id)
        return Response(status_code=499)
    rate = pipeline.output_sample_rate or PCM_RATE
    return _ClosingStreamingResponse(_events(completion, first, stream, rate, log_),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
