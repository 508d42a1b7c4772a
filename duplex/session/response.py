"""One response of the agent: from ``response.create`` (or the end of a turn) to ``response.done``.

A Response belongs to one session and lives until its ``response.done`` went out. It streams the
pipeline request its session built, sends the model's text as transcript deltas (as they come, so
always before the audio they describe) and hands the audio to the session's AgentAudio, and
finishes as ``completed`` (every sample played out or sent), ``cancelled`` (barge-in,
``response.cancel``, session end: the pipeline request is aborted and acknowledged first) or
``failed`` (a stage failed: an ``error`` event, and no success).

It talks to its session only through :class:`ResponseHost`; how the audio reaches the user (paced
by the server or played by the client) is the AgentAudio's business, never the response's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import numpy as np

from duplex import metrics
from duplex.media.playout import AgentAudio
from duplex.protocol.events import assistant_item, event, item_added, new_id, response_object
from duplex.session.history import Item
from duplex.session.model_pipeline import ModelPipeline
from pipeline.coordinator import PipelineError, PipelineOverloaded
from pipeline.proto import OmniRequest, OutputChunk

log = logging.getLogger(__name__)


class ResponseHost(Protocol):
    """What a response needs from its session."""

    @property
    def audio(self) -> AgentAudio:
        """Where the agent's audio goes."""

    @property
    def pipeline(self) -> ModelPipeline: ...

    def send(self, message: dict[str, Any]) -> None:
        """Send a server event to the client."""

    def on_first_audio(self, response: Response) -> None:
        """The response's first audio chunk came from the model."""

    def on_input_transcript(self, response: Response, transcript: str) -> None:
        """The model recognised the user's last turn as ``transcript``."""

    def on_response_done(self, response: Response) -> None:
        """``response.done`` went out: the response holds nothing any more."""


async def _no_chunks() -> AsyncIterator[OutputChunk]:
    return
    yield


def _phase(name: str, seconds: float) -> None:
    metrics.RESPONSE_PHASE_SECONDS.labels(name).observe(seconds)


class Response:
    """One response (see module doc). ``item`` is its assistant item, already in the history."""

    def __init__(self, host: ResponseHost, request: OmniRequest, item: Item, previous: str | None,
                 speaks: bool, output_format: str, turn_end_at: float | None,
                 log_extra: dict[str, str]) -> None:
        self.host = host
        self.id = new_id("resp")
        self.item = item
        self.request_id = request.request_id
        self.speaks = speaks
        self.turn_end_at = turn_end_at
        self.audio_samples = 0
        self.audio_rate = 24000
        self.submitted_at: float | None = None
        self.first_audio_at: float | None = None
        self.playout_started_at: float | None = None
        self.cancel_reason: str | None = None
        self.generation_done = False
        self._cancelled = asyncio.Event()
        self.log = logging.LoggerAdapter(log, {**log_extra, "request_id": self.request_id})
        if speaks:
            host.audio.begin(self.id, item.id, output_format)
        self._task = asyncio.get_running_loop().create_task(self._run(request, previous))

    @property
    def audio_ms(self) -> int:
        return self.audio_samples * 1000 // self.audio_rate

    async def cancel(self, reason: str) -> None:
        """Abort the pipeline request (acknowledged by every stage) and wait for response.done."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
            self._cancelled.set()
            await self.host.pipeline.abort(self.request_id)
        await asyncio.shield(self._task)

    async def _run(self, request: OmniRequest, previous: str | None) -> None:
        self.log.info("response %s: request %s", self.id, self.request_id)
        status, error = "completed", None
        self._announce(previous)
        try:
            await self._generate(request)
        except PipelineOverloaded as err:
            status, error = "failed", {"type": "server_error", "code": "overloaded", "message": str(err)}
        except PipelineError as err:
            status, error = "failed", {"type": "server_error", "code": "pipeline_error", "message": str(err)}
        if self.cancel_reason is not None:
            status = "cancelled"
        if error is not None:
            self.log.warning("response %s failed: %s", self.id, error["message"])
            self.host.send(event("error", error={**error, "param": None, "event_id": None}))
        self._finish(status, error)

    async def _generate(self, request: OmniRequest) -> None:
        # A response cancelled before this task ran never reaches the pipeline (its id is aborted).
        chunks = self.host.pipeline.stream(request) if self.cancel_reason is None else _no_chunks()
        self.submitted_at = time.monotonic()
        if self.turn_end_at is not None:
            _phase("turn_end_to_submit", self.submitted_at - self.turn_end_at)
        # aclosing: a task cancelled mid-stream aborts the request now, not when collected.
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:
                self._on_chunk(chunk.data)
        self.generation_done = True
        self.item.spoken_ms = self.audio_ms if self.speaks and self.audio_samples else None
        if self.speaks and self.cancel_reason is None:
            await self._until_cancelled(self.host.audio.drain())

    async def _until_cancelled(self, work: Any) -> None:
        """``work``, given up when the response is cancelled first."""
        task = asyncio.ensure_future(work)
        cancelled = asyncio.ensure_future(self._cancelled.wait())
        try:
            await asyncio.wait({task, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            task.cancel()
            cancelled.cancel()

    def _on_chunk(self, data: dict[str, Any]) -> None:
        if data.get("input_transcript") is not None:
            self.host.on_input_transcript(self, str(data["input_transcript"]))
        if data.get("text"):
            self._on_text(data["text"])
        audio = data.get("audio")
        if self.speaks and audio is not None and len(audio):
            self._on_audio(np.asarray(audio, dtype=np.float32), data["sample_rate"],
                           data.get("spoken_text"))

    def _send_part_event(self, kind: str, **fields: Any) -> None:
        self.host.send(event(kind, response_id=self.id, item_id=self.item.id, output_index=0,
                             content_index=0, **fields))

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_audio", "transcript": text} if self.speaks else {"type": "output_text", "text": text}

    def _announce(self, previous: str | None) -> None:
        send = self.host.send
        send(event("response.created", response=response_object(self.id, "in_progress", [])))
        item = assistant_item(self.item.id, self.speaks, "", "in_progress")
        send(event("response.output_item.added", response_id=self.id, output_index=0, item=item))
        for message in item_added(item, previous):
            send(message)
        self._send_part_event("response.content_part.added", part=self._part(""))

    def _on_text(self, text: str) -> None:
        self.item.deltas.append((text, self.audio_ms))
        kind = "response.output_audio_transcript.delta" if self.speaks else "response.output_text.delta"
        self._send_part_event(kind, delta=text)

    def _on_audio(self, audio: np.ndarray, rate: int, spoken_text: str | None) -> None:
        if self.cancel_reason is not None:
            return
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
            if self.submitted_at is not None:
                _phase("submit_to_first_audio", self.first_audio_at - self.submitted_at)
            self.host.on_first_audio(self)
        start_ms = self.audio_ms
        self.audio_rate = rate
        self.audio_samples += len(audio)
        if spoken_text is not None:
            self.item.spans.append((start_ms, self.audio_ms, spoken_text))
        self.host.audio.play(audio, rate)

    def on_playout_started(self) -> None:
        """The response's first audio reached the user (played out, or sent to the client)."""
        if self.playout_started_at is not None:
            return
        now = self.playout_started_at = time.monotonic()
        if self.first_audio_at is not None:
            _phase("first_audio_to_playout", now - self.first_audio_at)
        if self.turn_end_at is not None:
            metrics.VOICE_TO_VOICE_SECONDS.observe(now - self.turn_end_at)
            metrics.TURNS_TOTAL.inc()

    def _finish(self, status: str, error: dict[str, Any] | None) -> None:
        send = self.host.send
        text = self.item.transcript
        item = assistant_item(self.item.id, self.speaks, text, "completed" if status == "completed" else "incomplete")
        if self.speaks:
            self.host.audio.end_part()
            self._send_part_event("response.output_audio_transcript.done", transcript=text)
        else:
            self._send_part_event("response.output_text.done", text=text)
        self._send_part_event("response.content_part.done", part=self._part(text))
        send(event("response.output_item.done", response_id=self.id, output_index=0, item=item))
        send(event("conversation.item.done", item=item))
        send(event("response.done", response=response_object(
            self.id, status, [item], reason=self.cancel_reason, error=error)))
        if self.speaks:
            self.host.audio.finish(completed=status == "completed")
        self.host.on_response_done(self)
        self.log.info("response %s %s (%d ms of audio)", self.id, status, self.audio_ms)
