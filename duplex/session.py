"""One conversation: the turn state machine, barge-in, responses, history and truncation.

A Session is transport-agnostic: WebRTC and the Realtime WebSocket each create one per connection
and feed it inbound audio (``on_audio``, 16 kHz float32) and client events (``on_event``); it sends
server events through ``SessionTransport.send_event`` and agent audio through its ``AgentAudio``.
It reaches the model only through the coordinator (``stream`` / ``abort``).

States: listening → user_speaking → thinking → speaking → listening. Barge-in, while a response is
active and ``interrupt_response`` is on:

1. speech onset pauses the agent's audio at once (no event): a *possible* interruption;
2. speech that lasts ``interrupt_min_speech_ms`` confirms it: ``speech_started`` (with the real
   onset), ``output_audio_buffer.cleared`` (paced transports), the pipeline request is aborted and
   acknowledged, ``response.done`` (cancelled), ``conversation.item.truncated`` with the audio the
   user heard before the pause; the speech goes on as the user's next turn;
3. silence before that (a cough, a click) is a false interruption: the audio resumes where it
   paused and the fragment is discarded.

While the agent's audio is less than ``echo_guard_ms`` old the VAD threshold is raised to
``echo_guard_threshold`` so that the agent's own echo does not interrupt it.

Time: turn-taking runs on audio time (positions in the inbound stream), so it is deterministic for
the same audio; only metrics read the wall clock. State (the VAD, the history, the response in
flight, a pending interruption) belongs to this session and is released by ``close``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from duplex import metrics
from duplex.history import History, Item
from duplex.playout import AgentAudio
from duplex.realtime import RealtimeError, SessionConfig, event, new_id, session_object
from duplex.realtime_audio import InboundDecoder
from duplex.response import Response
from duplex.settings import SessionDefaults
from duplex.session_events import ClientEvents
from duplex.vad import SAMPLE_RATE, WINDOW, SpeechStarted, SpeechStopped, TurnDetection, TurnDetector
from pipeline.coordinator import Coordinator

log = logging.getLogger(__name__)

ARRIVALS_KEPT = 256  # ~5 s of 20 ms chunks: more than the VAD ever lags behind


class SessionTransport(Protocol):
    kind: str  # metrics label: webrtc | websocket

    def send_event(self, event: dict[str, Any]) -> None: ...


@dataclass
class _Interruption:
    """Speech over the agent, not yet confirmed; ``heard_ms`` is what was played before the pause."""

    onset_ms: int
    heard_ms: int


class Session:
    def __init__(
        self,
        session_id: str,
        transport: SessionTransport,
        audio: AgentAudio,
        pipeline: Coordinator,
        defaults: SessionDefaults,
        voices: list[str],
        model_name: str,
    ) -> None:
        self.id = session_id
        self.transport = transport
        self.audio = audio
        self.pipeline = pipeline
        self.defaults = defaults
        self.voices = voices
        self.model_name = model_name
        self.config = SessionConfig.from_defaults(defaults)
        self.history = History(defaults.max_input_audio_s)
        self.state = "listening"
        self.log = logging.LoggerAdapter(log, {"session_id": session_id})
        self._detector = TurnDetector(self._turn_detection())
        self._manual_buffer: list[np.ndarray] = []
        self._manual_samples = 0
        self._decoder = InboundDecoder(self.config.input_format)
        self._response: Response | None = None
        self._interruption: _Interruption | None = None
        self._user_item_id: str | None = None
        self._deferred_turn_end: float | None = None  # a turn that ended during a cancel
        self._truncating = False  # an interrupted response is being cancelled and truncated
        self._closed = False
        self._events = ClientEvents(self)
        # When each recent chunk of inbound audio arrived: (its end, in samples; monotonic time).
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=ARRIVALS_KEPT)
        self._received = 0

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self.send(event("session.created", session=self.session_object()))

    async def close(self) -> None:
        """End the session: abort the response in flight and release every piece of state."""
        if self._closed:
            return
        self._closed = True
        if self._response is not None:
            await self.cancel_response("session_closed")
        self._detector.reset()
        self.history.clear()
        self._manual_buffer.clear()
        self.log.info("session %s closed", self.id)

    def send(self, message: dict[str, Any]) -> None:
        if not self._closed:
            self.transport.send_event(message)

    def session_object(self) -> dict[str, Any]:
        return session_object(self.id, self.config, self.model_name)

    def _turn_detection(self) -> TurnDetection:
        td = self.config.turn_detection
        base = TurnDetection(max_turn_ms=int(self.defaults.max_input_audio_s * 1000))
        if td is None:
            return base
        return TurnDetection(td.threshold, td.prefix_padding_ms, td.silence_duration_ms, base.max_turn_ms)

    def reconfigure(self, config: SessionConfig) -> None:
        """Apply a validated session.update."""
        self.config = config
        self._detector.config = self._turn_detection()
        if config.input_format != self._decoder.format:
            self._decoder = InboundDecoder(config.input_format)

    # --- inbound audio --------------------------------------------------------------------

    def on_audio(self, samples: np.ndarray, received_at: float | None = None) -> None:
        """Inbound audio at 16 kHz (float32 mono), as it arrives; ``received_at`` is monotonic."""
        if self._closed:
            return
        received_at = time.monotonic() if received_at is None else received_at
        self._received += len(samples)
        self._arrivals.append((self._received, received_at))
        if self.config.turn_detection is None:
            self._append_manual(samples)
            return
        # One VAD window at a time: an interruption is confirmed (or dismissed) at the window where
        # it happens, even when a client sends a whole utterance in one chunk.
        for start in range(0, len(samples), WINDOW):
            self._detector.threshold_override = self._echo_guard()
            for turn_event in self._detector.process(samples[start : start + WINDOW]):
                if isinstance(turn_event, SpeechStarted):
                    self._on_onset(turn_event, received_at)
                else:
                    self._on_turn_end(turn_event)
            self._check_interruption()

    async def on_wire_audio(self, b64: str) -> None:
        """``input_audio_buffer.append`` audio, in the session's input format.

        A long append goes through the VAD a second of audio at a time, yielding between slices,
        so one client's upload never stalls the event loop that paces everyone's audio.
        """
        audio = self._decoder.decode(b64)
        for start in range(0, len(audio), SAMPLE_RATE):
            self.on_audio(audio[start : start + SAMPLE_RATE])
            await asyncio.sleep(0)

    def _append_manual(self, samples: np.ndarray) -> None:
        limit = int(self.defaults.max_input_audio_s * SAMPLE_RATE)
        if self._manual_samples + len(samples) > limit:
            raise RealtimeError(
                f"the input audio buffer is full ({self.defaults.max_input_audio_s:.0f} s)",
                code="input_audio_buffer_full",
            )
        self._manual_buffer.append(np.asarray(samples, dtype=np.float32))
        self._manual_samples += len(samples)

    def _echo_guard(self) -> float | None:
        """The raised VAD threshold while the agent's audio is young (audio time, not wall time)."""
        resp = self._response
        if resp is None or resp.playout_started_at is None:
            return None
        young = self.audio.heard_ms(resp.item.id) < self.defaults.echo_guard_ms
        return self.defaults.echo_guard_threshold if young else None

    def _agent_active(self) -> bool:
        td = self.config.turn_detection
        return self._response is not None and td is not None and td.interrupt_response

    def _on_onset(self, onset: SpeechStarted, received_at: float) -> None:
        if self._agent_active():
            assert self._response is not None
            self.audio.pause()
            self._interruption = _Interruption(onset.start_ms, self.audio.heard_ms(self._response.item.id))
            # From the arrival of the audio that holds the onset, so the VAD's own delay counts.
            metrics.BARGE_IN_STOP_SECONDS.observe(time.monotonic() - self._arrival(onset.start_ms, received_at))
            self.log.info("possible interruption at %d ms: agent audio paused", onset.start_ms)
            return
        self._speech_started(onset.start_ms)

    def _arrival(self, position_ms: int, fallback: float) -> float:
        sample = position_ms * SAMPLE_RATE // 1000
        return next((at for end, at in self._arrivals if end > sample), fallback)

    def _speech_started(self, onset_ms: int) -> None:
        self._user_item_id = new_id("item")
        self.state = "user_speaking"
        self.send(event("input_audio_buffer.speech_started", audio_start_ms=onset_ms,
                        item_id=self._user_item_id))

    def _check_interruption(self) -> None:
        pending = self._interruption
        if pending is None:
            return
        if not self._detector.in_speech:
            self._false_interruption()
        elif self._detector.speech_ms >= self.defaults.interrupt_min_speech_ms:
            self._confirm_interruption(pending)
        elif self._detector.silence_ms >= self.defaults.interrupt_min_speech_ms:
            self._detector.discard_turn()
            self._false_interruption()

    def _false_interruption(self) -> None:
        self._interruption = None
        self.audio.resume()
        self.log.info("false interruption: agent audio resumed")

    def _confirm_interruption(self, pending: _Interruption) -> None:
        self._interruption = None
        resp = self._response
        metrics.BARGE_INS_TOTAL.inc()
        self.log.info("interruption confirmed; the user heard %d ms", pending.heard_ms)
        self._speech_started(pending.onset_ms)
        if resp is None:
            return
        self.audio.clear()
        if self.audio.paces_playout:
            self.send(event("output_audio_buffer.cleared", response_id=resp.id))
        self.audio.resume()
        asyncio.get_running_loop().create_task(self._truncate_after_cancel(resp, pending.heard_ms))

    async def _truncate_after_cancel(self, resp: Response, heard_ms: int) -> None:
        self._truncating = True
        try:
            await self.cancel_response("turn_detected")
            self.truncate(resp.item, heard_ms)
        finally:
            self._truncating = False
        self._answer_deferred_turn()

    def truncate(self, item: Item, audio_end_ms: int) -> None:
        self.history.truncate(item, audio_end_ms)
        self.send(event("conversation.item.truncated", item_id=item.id, content_index=0,
                        audio_end_ms=audio_end_ms))

    def _on_turn_end(self, stop: SpeechStopped) -> None:
        if self._interruption is not None:
            self._false_interruption()
            return
        item_id = self._user_item_id or new_id("item")
        self._user_item_id = None
        self.send(event("input_audio_buffer.speech_stopped", audio_end_ms=stop.end_ms, item_id=item_id))
        self.commit_user_audio(item_id, stop.audio)
        td = self.config.turn_detection
        if td is None or not td.create_response:
            return
        if self._response is None:
            self.start_response(turn_end_at=time.monotonic())
        elif self._response.cancel_reason is not None:
            # The interrupted response is still being cancelled: answer once its done went out.
            self._deferred_turn_end = time.monotonic()

    # --- user items -----------------------------------------------------------------------

    def commit_manual_buffer(self) -> None:
        if not self._manual_buffer:
            raise RealtimeError("the input audio buffer is empty", code="input_audio_buffer_commit_empty")
        audio = np.concatenate(self._manual_buffer)
        self.clear_manual_buffer()
        self.commit_user_audio(new_id("item"), audio)

    def clear_manual_buffer(self) -> None:
        self._manual_buffer.clear()
        self._manual_samples = 0
        self._detector.discard_turn()

    def announce_added(self, item: dict[str, Any], previous: str | None) -> None:
        self._events.announce_added(item, previous)

    def commit_user_audio(self, item_id: str, audio: np.ndarray) -> None:
        previous = self.history.last_id
        self.history.add(Item(item_id, "user", audio=audio, sample_rate=SAMPLE_RATE))
        self.state = "thinking"
        self.send(event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id))
        self._events.announce_item(self.history.items[-1], previous)

    # --- responses ------------------------------------------------------------------------

    def start_response(self, turn_end_at: float | None = None, overrides: dict[str, Any] | None = None) -> None:
        if self._response is not None:
            raise RealtimeError("a response is already in progress",
                                code="conversation_already_has_active_response")
        self._response = Response(self, overrides or {}, turn_end_at)

    async def cancel_response(self, reason: str) -> bool:
        """Cancel the response in flight (if any) and wait until its response.done went out."""
        if self._response is None:
            return False
        await self._response.cancel(reason)
        return True

    def response_finished(self, resp: Response) -> None:
        """Called by the response once its response.done went out."""
        if self._response is resp:
            self._response = None
        if self.state in ("thinking", "speaking"):
            self.state = "listening"
        if not self._truncating:
            self._answer_deferred_turn()

    def _answer_deferred_turn(self) -> None:
        deferred, self._deferred_turn_end = self._deferred_turn_end, None
        if deferred is not None and not self._closed and self._response is None:
            self.start_response(turn_end_at=deferred)

    def on_playout(self, kind: str, item_id: str) -> None:
        """The paced track started an item's audio, or its queue ran dry."""
        if self._response is not None:
            self._response.on_playout(kind, item_id)

    # --- client events --------------------------------------------------------------------

    async def on_event(self, message: Any) -> None:
        """One client event (already parsed JSON); errors become ``error`` events."""
        await self._events.handle(message)
