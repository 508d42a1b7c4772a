"""One Twilio Media Stream (``GET /v1/telephony/twilio``) bound to a Session: a phone call that
Twilio bridges to the server over a WebSocket.

Twilio's protocol (its Media Streams, bidirectional): ``connected``, ``start`` (the stream's
``streamSid`` and the TwiML's ``customParameters``), ``media`` (base64 μ-law 8 kHz), ``mark``
(the echo of a mark we sent, once its audio was played), ``dtmf`` and ``stop`` come in; ``media``,
``mark`` and ``clear`` go out. Twilio plays whatever it receives, so the agent's voice goes through
a :class:`~duplex.media.marked_playout.MarkedPlayout`: marks tell what the caller heard, ``clear``
stops the audio at a barge-in's onset, and a false interruption sends again from the last
acknowledged mark.

Realtime server events have nowhere to go on a phone call: they are dropped (the session's log
keeps the story).

A socket costs nothing but itself until its ``start`` has been read and authenticated
(:func:`receive_start`, then ``duplex.api.twilio``): only then is a :class:`TwilioConnection` made,
with its Session, binding and registry slot. Until ``start`` it may send Twilio's one ``connected``
message and no other, each message at most :data:`MAX_START_CHARS`, within :data:`START_TIMEOUT_S`.
The connection owns its binding from ``admit`` until ``run`` returns: ``stop``, the socket closing
or the server shutting down end the session and release the slot once.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from duplex.media.inbound_budget import RealTimeBudget
from duplex.media.marked_playout import MarkedPlayout
from duplex.media.pcm import pcm16_to_float, ulaw_decode, ulaw_encode
from duplex.media.resample import Resampler
from duplex.protocol.events import new_id
from duplex.registry import SessionRegistry
from duplex.session.model_pipeline import ModelPipeline
from duplex.session.session import Session
from duplex.settings import ServerSettings
from duplex.transports.binding import Closing, SessionBinding
from duplex.turns.vad import SAMPLE_RATE as SESSION_RATE

log = logging.getLogger(__name__)

TWILIO_RATE = 8000
CLOSE_POLICY_VIOLATION = 1008
SHUTDOWN_GRACE_S = 5.0
# Twilio sends ``connected`` and ``start`` as soon as the socket is open; a socket that has not
# authenticated by then is closed (1008), so that idle sockets cannot pile up waiting.
START_TIMEOUT_S = 5.0
# A ``start`` is a few hundred bytes plus the TwiML's custom parameters (Twilio bounds those to a
# few KiB): a larger message before ``start`` is refused before it is parsed.
MAX_START_CHARS = 64 * 1024


class TwilioStreamError(ValueError):
    """A message that breaks the Media Streams protocol; the stream is closed with 1008."""


@dataclass(frozen=True)
class StreamStart:
    """What a stream's ``start`` message says; ``token`` is ``customParameters.token`` (a secret:
    never logged)."""

    stream_sid: str
    call_sid: str | None
    token: str | None = field(repr=False)


async def receive_start(websocket: WebSocket) -> StreamStart | None:
    """Read an accepted stream's messages up to its ``start`` (see module doc); None when the client
    left first. Raises TwilioStreamError for anything else, a message too large, or no ``start``
    within :data:`START_TIMEOUT_S`."""
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            connected = False
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return None
                raw = message.get("text") or message.get("bytes") or b""
                if len(raw) > MAX_START_CHARS:
                    raise TwilioStreamError(
                        f"a message before 'start' over {MAX_START_CHARS} characters")
                event = _parse(raw)
                kind = event.get("event")
                if kind == "start":
                    return _stream_start(event)
                if kind != "connected" or connected:
                    raise TwilioStreamError(f"{kind!r} before 'start'")
                connected = True
    except TimeoutError:
        raise TwilioStreamError(f"no 'start' within {START_TIMEOUT_S:g} s") from None


def _stream_start(event: dict[str, Any]) -> StreamStart:
    start = _field(event, "start", dict)
    fmt = start.get("mediaFormat") or {}
    if fmt and (fmt.get("encoding"), fmt.get("sampleRate")) != ("audio/x-mulaw", TWILIO_RATE):
        raise TwilioStreamError(f"unsupported media format {fmt}")
    parameters = start.get("customParameters")
    token = parameters.get("token") if isinstance(parameters, dict) else None
    call_sid = start.get("callSid")
    return StreamStart(str(event.get("streamSid") or start.get("streamSid") or ""),
                       str(call_sid) if call_sid is not None else None,
                       token if isinstance(token, str) else None)


class TwilioConnection:
    """One authenticated stream, made from its :class:`StreamStart` (see module doc)."""

    kind = "twilio"

    def __init__(self, websocket: WebSocket, settings: ServerSettings, pipeline: ModelPipeline,
                 registry: SessionRegistry, model_name: str, start: StreamStart) -> None:
        self.id = new_id("twilio")
        self.websocket = websocket
        self.stream_sid = start.stream_sid
        self._outbox: asyncio.Queue[dict[str, Any] | Closing] = asyncio.Queue()
        self.playout = MarkedPlayout(TWILIO_RATE, self._media, self._mark, self._clear)
        self.session = Session(self.id, self, self.playout, pipeline, settings.session,
                               settings.voices, model_name)
        self.binding = SessionBinding(self.session, registry, self._close,
                                      record_dir=settings.record_dir)
        self._inbound = Resampler(TWILIO_RATE, SESSION_RATE)
        self._task: asyncio.Task[Any] | None = None
        self.log = logging.LoggerAdapter(log, {"session_id": self.id})
        self._budget = RealTimeBudget("twilio", self.log)
        self.log.info("stream %s authenticated (call %s)", self.stream_sid, start.call_sid)

    def admit(self) -> None:
        """Take a registry slot; raises TooManySessions."""
        self.binding.admit()

    async def run(self) -> None:
        """Serve the stream until it ends, then release everything (call after ``admit``)."""
        self._task = asyncio.current_task()
        writer = asyncio.get_running_loop().create_task(self._write())
        reason = "cancelled"
        try:
            self.binding.start()
            reason = await self._read()
        except TwilioStreamError as err:
            reason = f"protocol error: {err}"
            self.log.warning("closing the stream: %s", err)
            await self.websocket.close(CLOSE_POLICY_VIOLATION, str(err)[:120])
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            await self.binding.end(f"twilio {reason}")

    async def _close(self, closing: Closing) -> None:
        self._outbox.put_nowait(closing)  # the writer closes the socket after what is queued
        await self.binding.ended_within(SHUTDOWN_GRACE_S, self._task)

    # --- SessionTransport --------------------------------------------------------------------

    def send_event(self, event: dict[str, Any]) -> None:
        """A phone call has no events channel."""

    # --- out: what MarkedPlayout sends ---------------------------------------------------------

    def _media(self, samples: np.ndarray) -> None:
        payload = base64.b64encode(ulaw_encode(samples)).decode("ascii")
        self._outbox.put_nowait({"event": "media", "streamSid": self.stream_sid,
                                 "media": {"payload": payload}})

    def _mark(self, name: str) -> None:
        self._outbox.put_nowait({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})

    def _clear(self) -> None:
        self._outbox.put_nowait({"event": "clear", "streamSid": self.stream_sid})

    async def _write(self) -> None:
        while not isinstance(message := await self._outbox.get(), Closing):
            try:
                await self.websocket.send_text(json.dumps(message))
            except (WebSocketDisconnect, RuntimeError, OSError) as err:
                self.log.info("twilio send failed: %s", err)
                return
        await self.websocket.close(message.websocket_code, message.reason)

    # --- in --------------------------------------------------------------------------------

    async def _read(self) -> str:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return f"closed with {message.get('code')}"
            event = _parse(message.get("text") or message.get("bytes") or b"")
            kind = event.get("event")
            if kind == "stop":
                return "stop"
            elif kind == "media":
                self._on_media(event)
            elif kind == "mark":
                self.playout.on_mark(str(_field(event, "mark", dict).get("name", "")))
            elif kind == "dtmf":
                self.session.on_dtmf(str(_field(event, "dtmf", dict).get("digit", "")))

    def _on_media(self, event: dict[str, Any]) -> None:
        media = _field(event, "media", dict)
        if media.get("track", "inbound") != "inbound":
            return
        payload = str(media.get("payload", ""))
        # μ-law: a byte a sample, three bytes for every four base64 characters; charged before
        # anything is decoded, as RTP is.
        if not self._budget.admit((len(payload) * 3 // 4 - payload[-2:].count("=")) / TWILIO_RATE):
            return
        try:
            pcm = ulaw_decode(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError) as err:
            raise TwilioStreamError(f"media payload is not base64: {err}") from None
        samples = self._inbound.push(pcm16_to_float(pcm))
        if len(samples):
            self.binding.on_audio(samples, time.monotonic())


def _parse(raw: str | bytes) -> dict[str, Any]:
    try:
        event = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise TwilioStreamError(f"not JSON: {err}") from None
    if not isinstance(event, dict):
        raise TwilioStreamError("a message must be a JSON object")
    return event


def _field(event: dict[str, Any], name: str, kind: type) -> Any:
    value = event.get(name)
    if not isinstance(value, kind):
        raise TwilioStreamError(f"{event.get('event')!r} needs a {name!r} object")
    return value
