"""One response of the agent: from ``response.create`` (or the end of a turn) to ``response.done``.

A Response belongs to one session and lives until its ``response.done`` went out. It builds the
pipeline request from the session's history, streams the model's text (transcript deltas, sent as
they come, so always before the audio they describe) and audio (to the session's AgentAudio), and
finishes as ``completed`` (every sample played out, on paced transports), ``cancelled`` (barge-in,
``response.cancel``, session end: the pipeline request is aborted and acknowledged first) or
``failed`` (a stage failed: an ``error`` event, and no success).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import numpy as np

from duplex import metrics
from duplex.history import Item
from duplex.realtime import assistant_item, event, new_id, response_object
from duplex.realtime_audio import OutboundEncoder
from pipeline.coordinator import PipelineError, PipelineOverloaded
from pipeline.proto import OmniRequest, OutputChunk

if TYPE_CHECKING:
    from duplex.session import Session

log = logging.getLogger(__name__)


async def _no_chunks() -> AsyncGenerator[OutputChunk, None]:
    return
    yield


def _phase(name: str, seconds: float) -> None:
    metrics.RESPONSE_PHASE_SECONDS.labels(name).observe(seconds)


class Response:
    def __init__(self, session: Session, overrides: dict[str, Any], turn_end_at: float | None) -> None:
        self.session = session
        self.id = new_id("resp")
        self.item = Item(new_id("item"), "assistant")
        self.request_id = new_id("req")
        config = session.config
        modalities = overrides.get("output_modalities") or list(config.output_modalities)
        self.speaks = "audio" in modalities
        self.turn_end_at = turn_end_at
        self.audio_samples = 0
        self.audio_rate = 24000
        self.submitted_at: float | None = None
        self.first_audio_at: float | None = None
        self.playout_started_at: float | None = None
        self.cancel_reason: str | None = None
        self.generation_done = False
        self._drained = asyncio.Event()
        self._encoder: OutboundEncoder | None = None
        if self.speaks and not session.audio.paces_playout:
            self._encoder = OutboundEncoder(config.output_format, session.pipeline.output_sample_rate or 24000)
        params = {
            "modalities": ["text", "audio"] if self.speaks else ["text"],
            "voice": config.voice,
            "max_output_tokens": overrides.get("max_output_tokens", config.max_output_tokens),
        }
        instructions = overrides.get("instructions", config.instructions)
        request = OmniRequest(self.request_id, {"messages": session.history.messages(instructions)}, params)
        previous = session.history.last_id
        session.history.add(self.item)  # now, so that turns committed meanwhile come after it
        self.log = logging.LoggerAdapter(log, {"session_id": session.id})
        self._task = asyncio.get_running_loop().create_task(self._run(request, previous))

    @property
    def audio_ms(self) -> int:
        return self.audio_samples * 1000 // self.audio_rate

    async def cancel(self, reason: str) -> None:
        """Abort the pipeline request (acknowledged by every stage) and wait for response.done."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
            self._drained.set()
            await self.session.pipeline.abort(self.request_id)
        await asyncio.shield(self._task)

    async def _run(self, request: OmniRequest, previous: str | None) -> None:
        self.log.info("response %s: request %s", self.id, self.request_id)
        status, error = "completed", None
        self._announce(previous)
        try:
            # A response cancelled before this task ran never reaches the pipeline (its id is aborted).
            chunks = self.session.pipeline.stream(request) if self.cancel_reason is None else _no_chunks()
            self.submitted_at = time.monotonic()
            if self.turn_end_at is not None:
                _phase("turn_end_to_submit", self.submitted_at - self.turn_end_at)
            # aclosing: a task cancelled mid-stream aborts the request now, not when collected.
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if chunk.data.get("text"):
                        self._on_text(chunk.data["text"])
                    audio = chunk.data.get("audio")
                    if self.speaks and audio is not None and len(audio):
                        self._on_audio(np.asarray(audio, dtype=np.float32), chunk.data["sample_rate"])
            self.generation_done = True
            self.item.spoken_ms = self.audio_ms if self.speaks and self.audio_samples else None
            if self.speaks and self.audio_samples:
                self.session.audio.end_item(self.item.id)
                if self.session.audio.paces_playout:
                    await self._wait_played()
        except PipelineOverloaded as err:
            status, error = "failed", {"type": "server_error", "code": "overloaded", "message": str(err)}
        except PipelineError as err:
            status, error = "failed", {"type": "server_error", "code": "pipeline_error", "message": str(err)}
        if self.cancel_reason is not None:
            status = "cancelled"
        if error is not None:
            self.log.warning("response %s failed: %s", self.id, error["message"])
            self.session.send(event("error", error={**error, "param": None, "event_id": None}))
        self._finish(status, error)

    def _send_part_event(self, kind: str, **fields: Any) -> None:
        self.session.send(event(kind, response_id=self.id, item_id=self.item.id, output_index=0,
                                content_index=0, **fields))

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_audio", "transcript": text} if self.speaks else {"type": "output_text", "text": text}

    def _announce(self, previous: str | None) -> None:
        send = self.session.send
        send(event("response.created", response=response_object(self.id, "in_progress", [])))
        item = assistant_item(self.item.id, self.speaks, "", "in_progress")
        send(event("response.output_item.added", response_id=self.id, output_index=0, item=item))
        self.session.announce_added(item, previous)
        self._send_part_event("response.content_part.added", part=self._part(""))

    def _on_text(self, text: str) -> None:
        self.item.deltas.append((text, self.audio_ms))
        kind = "response.output_audio_transcript.delta" if self.speaks else "response.output_text.delta"
        self._send_part_event(kind, delta=text)

    def _on_audio(self, audio: np.ndarray, rate: int) -> None:
        if self.cancel_reason is not None:
            return
        now = time.monotonic()
        if self.first_audio_at is None:
            self.first_audio_at = now
            if self.submitted_at is not None:
                _phase("submit_to_first_audio", now - self.submitted_at)
            self.session.state = "speaking"
            if not self.session.audio.paces_playout:
                self._playout_started(now)
        self.audio_rate = rate
        self.audio_samples += len(audio)
        self.session.audio.play(self.item.id, audio, rate)
        if self._encoder is not None:
            delta, _ = self._encoder.encode(audio)
            self._send_part_event("response.output_audio.delta", delta=delta)

    def _playout_started(self, now: float) -> None:
        self.playout_started_at = now
        if self.first_audio_at is not None and self.session.audio.paces_playout:
            _phase("first_audio_to_playout", now - self.first_audio_at)
        if self.turn_end_at is not None:
            metrics.VOICE_TO_VOICE_SECONDS.observe(now - self.turn_end_at)
            metrics.TURNS_TOTAL.inc()

    def on_playout(self, kind: str, item_id: str) -> None:
        """The paced track started this response's audio, or its queue ran dry."""
        if item_id != self.item.id:
            return
        if kind == "started" and self.playout_started_at is None:
            self._playout_started(time.monotonic())
            self.session.send(event("output_audio_buffer.started", response_id=self.id))
        elif kind == "drained":
            self._drained.set()

    async def _wait_played(self) -> None:
        while self.cancel_reason is None and self.session.audio.queued_seconds() > 0:
            self._drained.clear()
            await self._drained.wait()

    def _finish(self, status: str, error: dict[str, Any] | None) -> None:
        send = self.session.send
        text = self.item.transcript
        item = assistant_item(self.item.id, self.speaks, text, "completed" if status == "completed" else "incomplete")
        if self._encoder is not None:
            self._send_part_event("response.output_audio.done")
        if self.speaks:
            self._send_part_event("response.output_audio_transcript.done", transcript=text)
        else:
            self._send_part_event("response.output_text.done", text=text)
        self._send_part_event("response.content_part.done", part=self._part(text))
        send(event("response.output_item.done", response_id=self.id, output_index=0, item=item))
        send(event("conversation.item.done", item=item))
        send(event("response.done", response=response_object(
            self.id, status, [item], reason=self.cancel_reason, error=error)))
        if status == "completed" and self.audio_samples and self.session.audio.paces_playout:
            send(event("output_audio_buffer.stopped", response_id=self.id))
        self.session.audio.release(self.item.id)
        self.session.response_finished(self)
        self.log.info("response %s %s (%d ms of audio)", self.id, status, self.audio_ms)
