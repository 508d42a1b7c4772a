"""One response of the agent: from ``response.create`` (or the end of a turn) to ``response.done``.

A Response belongs to one session and lives until its ``response.done`` went out. It streams the
pipeline request its session built, sends the model's text as transcript deltas (as they come, so
always before the audio they describe) and hands the audio to the session's AgentAudio, and
finishes as ``completed`` (every sample played out or sent), ``cancelled`` (barge-in,
``response.cancel``, session end: the pipeline request is aborted and acknowledged first, or
refused where the abort overtook its submission) or ``failed`` (a stage failed, or anything else
broke it: an ``error`` event, and no success). It always ends with its ``response.done``.

Its output items are announced as they start: the assistant message at its first text or audio,
a function call (``function_call`` chunks of the model: name, argument deltas) at its first piece;
a response that made only a call has no message. ``response.create`` options (voice, modalities,
caps, metadata, out of band) come in its :class:`ResponseSpec`.

The call it makes (a function call for the client, or an MCP tool call the server runs once the
model's answer ended, with ``follow_up`` the response that answers its result) is its
:class:`~duplex.session.response_call.ResponseCall`'s. While an MCP call runs slowly, a response
that said nothing before it may be asked to say the preset's filler (:meth:`Response.say_filler`,
:mod:`duplex.session.call_wait`): a request of its own, whose words and audio are the response's
message, after the call item.

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
from duplex.protocol.events import (
    assistant_item,
    event,
    item_added,
    new_id,
    response_object,
    usage_object,
)
from duplex.protocol.response_create import ResponseSpec
from duplex.session.conversation import Conversation
from duplex.session.history import Item, voiced_tokens
from duplex.session.model_pipeline import ModelPipeline
from duplex.session.response_call import ResponseCall, ServerFunction
from duplex.tools.mcp_items import McpCall
from duplex.tools.mcp_session import McpTools
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

    @property
    def conversation(self) -> Conversation:
        """Where the response's items go (a function call may take its message item's place)."""

    @property
    def mcp(self) -> McpTools:
        """The session's MCP servers: the tools they offer, and calls."""

    def on_mcp_call(self, response: Response, running: bool) -> None:
        """The response's MCP call began to run (``running``), or is over."""

    @property
    def server_function(self) -> ServerFunction | None:
        """The function tool the session's transport runs itself, if it has one."""


async def _no_chunks() -> AsyncIterator[OutputChunk]:
    return
    yield


def _phase(name: str, seconds: float) -> None:
    metrics.RESPONSE_PHASE_SECONDS.labels(name).observe(seconds)


class Response:
    """One response (see module doc). ``item`` is its assistant item: in the history, announced as
    a conversation item after ``previous``, unless the response is out of band
    (``conversation_id`` None: ``response.create`` with ``conversation: "none"``)."""

    def __init__(self, host: ResponseHost, request: OmniRequest, item: Item, previous: str | None,
                 spec: ResponseSpec, conversation_id: str | None, turn_end_at: float | None,
                 log_extra: dict[str, str], chunks: AsyncIterator[OutputChunk] | None = None) -> None:
        self.host = host
        self.id = new_id("resp")
        self.item = item
        self.request_id = request.request_id
        self.spec = spec
        self.speaks = spec.speaks
        self.conversation_id = conversation_id
        self.turn_end_at = turn_end_at
        self.input_audio_s = sum(len(m["audio"]) / m["sample_rate"] for m in request.inputs["messages"]
                                 if m.get("audio") is not None)
        self.text_deltas = 0
        self.model_usage: dict[str, Any] | None = None  # the model's token counts, when it reports them
        # The output_index of each output item, given as it is announced: the message before its
        # first text or audio, the function call at its first piece.
        self._outputs: dict[str, int] = {}
        self._previous: str | None = None
        self.audio_samples = 0
        self.audio_rate = 24000
        self.submitted_at: float | None = None
        self.first_audio_at: float | None = None
        self.playout_started_at: float | None = None
        self.cancel_reason: str | None = None
        self.generation_done = False
        self._filler: asyncio.Task[None] | None = None  # the filler said while its MCP call runs
        self._filler_request: str | None = None
        self._cancelled = asyncio.Event()
        # The answer tokens the text so far covers, where the model counts them (``text_tokens``).
        self._text_tokens: int | None = None
        self.log = logging.LoggerAdapter(log, {**log_extra, "request_id": self.request_id})
        self._response_call = ResponseCall(host, self.id, item, spec, conversation_id, self._outputs,
                                           self.log)
        # A speculative request's chunks (already submitted at a pause of the turn), or None.
        self._adopted = _no_chunks() if self._response_call.approved is not None else chunks
        if self.speaks:
            host.audio.begin(self.id, item.id, spec.output_format)
        self._task = asyncio.get_running_loop().create_task(self._run(request, previous))

    @property
    def call(self) -> Item | None:
        """The call item of the response, once the model started one."""
        return self._response_call.item

    @property
    def call_answered_by_server(self) -> bool:
        """Whether the server gives the call's output (its transport's function)."""
        return self._response_call.server_answers

    @property
    def follow_up(self) -> ResponseSpec | None:
        """The response that answers the output of the MCP call this response ran."""
        return self._response_call.follow_up

    @property
    def audio_ms(self) -> int:
        return self.audio_samples * 1000 // self.audio_rate

    @property
    def said_anything(self) -> bool:
        """Whether the response's message began (text or audio came)."""
        return self.item.id in self._outputs

    def say_filler(self, request: OmniRequest) -> None:
        """Say the words ``request`` gives (the preset's filler) as the response's message, while
        its MCP call runs (module doc); at most once, and only before it said anything."""
        if self._filler is None and not self.said_anything and self.cancel_reason is None:
            self._filler_request = request.request_id
            self._filler = asyncio.get_running_loop().create_task(self._say(request))

    async def cancel(self, reason: str, heard_ms: int | None = None) -> None:
        """Abort the pipeline request (acknowledged by every stage) and wait for response.done.

        ``heard_ms``: the user heard that much of the answer (a barge-in); a model that keeps the
        conversation's state keeps the answer tokens voiced by then, and forgets the rest (the
        item's truncation to ``heard_ms`` keeps the text of the same tokens: see History).
        """
        if self.cancel_reason is None:
            self.cancel_reason = reason
            self._cancelled.set()
            # The message's audio is the filler's where one was said (the answer was a call).
            speaking, done = ((self._filler_request, self.request_id) if self._filler_request is not None
                              else (self.request_id, None))
            await self.host.pipeline.abort(speaking, keep_answer_tokens=self._tokens_heard(heard_ms))
            if done is not None:
                await self.host.pipeline.abort(done)
        await asyncio.shield(self._task)

    def _tokens_heard(self, heard_ms: int | None) -> int | None:
        """The answer tokens voiced by the audio chunk being heard at ``heard_ms`` (the model says
        how many each chunk voiced, counting from the answer's start), if it says so."""
        return None if heard_ms is None else voiced_tokens(self.item, heard_ms)

    async def _run(self, request: OmniRequest, previous: str | None) -> None:
        self.log.info("response %s: request %s", self.id, self.request_id)
        status, error = "completed", None
        self._announce(previous)
        try:
            if self._response_call.approved is not None:
                self._response_call.start_approved()
            await self._generate(request)
            await self._run_call()
        except PipelineOverloaded as err:
            status, error = "failed", {"type": "server_error", "code": "overloaded", "message": str(err)}
        except PipelineError as err:
            status, error = "failed", {"type": "server_error", "code": "pipeline_error", "message": str(err)}
        except Exception as err:  # a response always ends with its response.done
            if self.cancel_reason is None:
                self.log.exception("response %s broke", self.id)
                status, error = "failed", {"type": "server_error", "code": "server_error",
                                           "message": f"the response broke: {err}"}
            else:
                # The cancel overtook the submission (the coordinator held the request for the
                # conversation's piece in flight, and the abort ended its id): nothing ran.
                self.log.info("response %s cancelled before its request was submitted: %s", self.id, err)
        if self.cancel_reason is not None:
            status = "cancelled"
        if error is not None:
            self.log.warning("response %s failed: %s", self.id, error["message"])
            self.host.send(event("error", error={**error, "param": None, "event_id": None}))
        self._finish(status, error)

    async def _generate(self, request: OmniRequest) -> None:
        # A response cancelled before this task ran never reaches the pipeline (its id is aborted);
        # an adopted speculation was submitted before the turn ended (and its abort ends it).
        if self._adopted is not None:
            chunks = self._adopted
        elif self.cancel_reason is None:
            chunks = self.host.pipeline.stream(request)
            self.submitted_at = time.monotonic()
            if self.turn_end_at is not None:
                _phase("turn_end_to_submit", self.submitted_at - self.turn_end_at)
        else:
            chunks = _no_chunks()
        await self._stream(chunks)
        self.generation_done = True
        await self._played()

    async def _stream(self, chunks: AsyncIterator[OutputChunk]) -> None:
        """Take ``chunks`` into the response."""
        # aclosing: a task cancelled mid-stream aborts the request now, not when collected.
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:
                self._on_chunk(chunk.data)
        self.item.spoken_ms = self.audio_ms if self.speaks and self.audio_samples else None

    async def _played(self) -> None:
        """Wait until the response's audio so far played out (or it is cancelled)."""
        if self.speaks and self.cancel_reason is None:
            await self._until_cancelled(self.host.audio.drain())

    async def _run_call(self) -> None:
        """Run the MCP call the response made, if it made one; a filler said meanwhile ends
        before the response does."""
        mcp = self.call is not None and isinstance(self.call.call, McpCall)
        if mcp:
            self.host.on_mcp_call(self, True)
        try:
            await self._response_call.run(self._until_cancelled, lambda: self.cancel_reason is not None)
        finally:
            if mcp:
                self.host.on_mcp_call(self, False)
            if self._filler is not None:
                await asyncio.shield(self._filler)

    async def _say(self, request: OmniRequest) -> None:
        self.log.info("response %s says the filler: request %s", self.id, request.request_id)
        try:
            await self._stream(self.host.pipeline.stream(request))
            await self._played()
        except PipelineError as err:  # the call goes on without its filler
            self.log.warning("response %s: the filler failed: %s", self.id, err)

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
        self.model_usage = data.get("usage") or self.model_usage
        if data.get("input_transcript") is not None:
            self.host.on_input_transcript(self, str(data["input_transcript"]))
        if data.get("text_tokens") is not None:  # counted before the text: it covers them
            self._text_tokens = (self._text_tokens or 0) + int(data["text_tokens"])
        if data.get("text"):
            self._on_text(data["text"])
        if data.get("function_call") and self.cancel_reason is None:
            self._response_call.on_piece(data["function_call"])
        audio = data.get("audio")
        if self.speaks and audio is not None and len(audio):
            voiced = data.get("answer_tokens")
            self._on_audio(np.asarray(audio, dtype=np.float32), data["sample_rate"],
                           data.get("spoken_text"), None if voiced is None else int(voiced))

    def _send_part_event(self, kind: str, **fields: Any) -> None:
        self.host.send(event(kind, response_id=self.id, item_id=self.item.id,
                             output_index=self._outputs[self.item.id], content_index=0, **fields))

    def _part(self, text: str) -> dict[str, Any]:
        # The GA content_part events name parts "audio" / "text" (items say output_audio / output_text).
        return {"type": "audio", "transcript": text} if self.speaks else {"type": "text", "text": text}

    def _object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None) -> dict[str, Any]:
        spec = self.spec
        return response_object(self.id, status, output, conversation_id=self.conversation_id,
                               modalities=spec.output_modalities, audio_format=spec.output_format,
                               voice=spec.voice, max_output_tokens=spec.max_output_tokens,
                               metadata=spec.metadata, usage=usage, reason=self.cancel_reason, error=error)

    def _usage(self) -> dict[str, Any]:
        # Models that report usage (qwen3_omni's thinker) give exact counts; otherwise the text
        # deltas stand in for output tokens and the input is not counted.
        usage = self.model_usage or {}
        return usage_object(int(usage.get("prompt_tokens", 0)),
                            int(usage.get("completion_tokens", self.text_deltas)),
                            self.input_audio_s, self.audio_ms / 1000 if self.speaks else 0.0,
                            int(usage.get("cached_tokens", 0)))

    def _announce(self, previous: str | None) -> None:
        self._previous = previous
        self.host.send(event("response.created", response=self._object("in_progress", [])))

    def _announce_message(self) -> None:
        """The message item's first events: before its first text or audio, or at the end of a
        response that has neither and made no function call."""
        if self.item.id in self._outputs:
            return
        self._outputs[self.item.id] = len(self._outputs)
        previous = self._previous
        if self.call is not None and self.conversation_id is not None:
            previous = self.host.conversation.add(self.item)  # after the call, which took its place
        item = assistant_item(self.item.id, self.speaks, "", "in_progress")
        self.host.send(event("response.output_item.added", response_id=self.id,
                             output_index=self._outputs[self.item.id], item=item))
        if self.conversation_id is not None:
            for message in item_added(item, previous):
                self.host.send(message)
        self._send_part_event("response.content_part.added", part=self._part(""))

    def _on_text(self, text: str) -> None:
        self._announce_message()
        self.item.deltas.append((text, self.audio_ms))
        if self._text_tokens is not None:
            self.item.delta_tokens.append(self._text_tokens)
        self.text_deltas += 1
        kind = "response.output_audio_transcript.delta" if self.speaks else "response.output_text.delta"
        self._send_part_event(kind, delta=text)

    def _finish_message(self, status: str) -> dict[str, Any]:
        """The message item's closing events; its final wire form."""
        text = self.item.transcript
        item = assistant_item(self.item.id, self.speaks, text, "completed" if status == "completed" else "incomplete")
        if self.speaks:
            self.host.audio.end_part()
            self._send_part_event("response.output_audio_transcript.done", transcript=text)
        else:
            self._send_part_event("response.output_text.done", text=text)
        self._send_part_event("response.content_part.done", part=self._part(text))
        self.host.send(event("response.output_item.done", response_id=self.id,
                             output_index=self._outputs[self.item.id], item=item))
        if self.conversation_id is not None:
            self.host.send(event("conversation.item.done", item=item))
        return item

    def _on_audio(self, audio: np.ndarray, rate: int, spoken_text: str | None, voiced: int | None) -> None:
        if self.cancel_reason is not None:
            return
        self._announce_message()
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
        if voiced is not None:
            self.item.voiced.append((self.audio_ms, voiced))
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
        if self.call is None:
            self._announce_message()
        outputs: dict[str, dict[str, Any]] = {}
        if self.item.id in self._outputs:  # not when only a function call came: no message, no audio
            outputs[self.item.id] = self._finish_message(status)
        call = self._response_call.finish(status)
        if call is not None:
            outputs[call["id"]] = call
        output = [outputs[i] for i in sorted(outputs, key=self._outputs.__getitem__)]
        self.host.send(event("response.done", response=self._object(status, output, self._usage(), error)))
        if status != "completed":
            self._response_call.follow_up = None
        if self.conversation_id is not None:
            self.host.mcp.response_ended(called=self.follow_up is not None)
        if self.speaks:
            self.host.audio.finish(completed=status == "completed")
        self.host.on_response_done(self)
        self.log.info("response %s %s (%d ms of audio)", self.id, status, self.audio_ms)
