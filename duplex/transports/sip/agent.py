"""Phone calls answered by the agent: each accepted SIP call bound to a Session.

The one module of ``sip/`` that knows the session layer. :class:`SipAgent` is the SIP server's
acceptor: for each INVITE it admits a session (``TooManySessions`` becomes a 503) and returns a
:class:`SipSessionCall`, which carries the call's audio both ways for its whole life:

- inbound: 8 kHz G.711, decoded by the stack to int16, resampled to the session's 16 kHz;
- outbound: the agent's voice through a ``PacedPlayout`` on an 8 kHz :class:`FrameQueue`, from
  which the stack's RTP sender pulls a 160-sample frame every 20 ms (``next_frame``): barge-in
  holds or flushes that queue, so the caller hears the agent stop within a frame;
- DTMF: each key press reaches the session (``Session.on_dtmf``);
- hold: the queue is paused while the caller holds (the stack suspends the inbound timeout);
- silence: a phone may stop sending RTP when the caller is quiet (VAD/DTX, comfort noise, or a
  test caller playing a file). Turn-taking runs on audio time, so a gap longer than
  ``GAP_FILL_AFTER_S`` is filled with silence on the 20 ms tick of the outbound sender.

There is no events channel on a phone call: server events are dropped (the session log keeps the
story). The call ends once, whoever ends it: ``on_ended`` from the stack (BYE, CANCEL, media
timeout, server close) or the server hanging up (registry, shutdown) through ``CallControl``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from duplex.media.frame_queue import FrameQueue
from duplex.media.pcm import pcm16_to_float
from duplex.media.playout import PacedPlayout
from duplex.media.resample import Resampler
from duplex.registry import SessionRegistry, TooManySessions
from duplex.session.model_pipeline import ModelPipeline
from duplex.session.session import Session
from duplex.settings import ServerSettings
from duplex.transports.binding import Closing, SessionBinding
from duplex.transports.sip.handler import (
    FRAME_SAMPLES,
    SAMPLE_RATE,
    CallControl,
    CallRefused,
    EndReason,
    SipCallInfo,
)
from duplex.turns.vad import SAMPLE_RATE as SESSION_RATE

log = logging.getLogger(__name__)

GAP_FILL_AFTER_S = 0.1  # later than any jitter a packet of a live call arrives with
FRAME_S = FRAME_SAMPLES / SAMPLE_RATE


class SipSessionCall:
    """One phone call bound to a Session (see module doc); a CallMedia and a SessionTransport."""

    kind = "sip"

    def __init__(self, info: SipCallInfo, control: CallControl, settings: ServerSettings,
                 pipeline: ModelPipeline, registry: SessionRegistry, model_name: str) -> None:
        self.id = f"sip_{info.call_id}"
        self.info = info
        self._control = control
        self.queue = FrameQueue(SAMPLE_RATE, FRAME_SAMPLES)
        self.session = Session(self.id, self, PacedPlayout(self.queue), pipeline, settings.session,
                               settings.voices, model_name)
        # The stack ends a call without RTP itself (and knows about hold): no timeout here.
        self.binding = SessionBinding(self.session, registry, self._hang_up,
                                      record_dir=settings.record_dir)
        self._inbound = Resampler(SAMPLE_RATE, SESSION_RATE)
        self._received = 0  # inbound samples at 8 kHz
        self._heard_until: float | None = None  # monotonic time the inbound audio reaches
        self._held = False
        self._ending: asyncio.Task[None] | None = None
        self.log = logging.LoggerAdapter(log, {"session_id": self.id})

    def start(self) -> None:
        """Admit the session (raises TooManySessions) and start it."""
        self.binding.admit()
        self.binding.start()
        self.log.info("call from %s (%s, dtmf %s)", self.info.from_uri, self.info.codec,
                      self.info.dtmf)

    async def _hang_up(self, closing: Closing) -> None:
        self.log.info("hanging up: %s", closing.reason)
        self._control.hangup()  # the stack answers with on_ended("hangup")

    # --- SessionTransport --------------------------------------------------------------------

    def send_event(self, event: dict[str, Any]) -> None:
        """A phone call has no events channel."""

    # --- CallMedia ---------------------------------------------------------------------------

    def on_audio(self, pcm: np.ndarray, arrival: float) -> None:
        self._received += len(pcm)
        self._heard_until = arrival
        self._feed(pcm16_to_float(pcm), arrival)

    def _feed(self, audio: np.ndarray, arrival: float) -> None:
        samples = self._inbound.push(audio)
        if len(samples):
            self.binding.on_audio(samples, arrival)

    def _fill_gap(self, now: float) -> None:
        """Silence for the time no RTP arrived (beyond jitter), so that turns can end."""
        if self._heard_until is None or self._held:
            return
        frames = int((now - self._heard_until - GAP_FILL_AFTER_S) / FRAME_S)
        if frames > 0:
            self._feed(np.zeros(frames * FRAME_SAMPLES, dtype=np.float32), now)
            self._heard_until += frames * FRAME_S

    def on_dtmf(self, digit: str) -> None:
        self.session.on_dtmf(digit)

    def on_hold(self, held: bool) -> None:
        self.log.info("call %s", "held" if held else "resumed")
        self._held = held
        self._heard_until = None  # no filling across a hold: its silence is not the caller's
        if held:
            self.queue.pause()
        else:
            self.queue.resume()

    def next_frame(self) -> np.ndarray | None:
        self._fill_gap(time.monotonic())
        return self.queue.next_frame()

    def on_ended(self, reason: EndReason) -> None:
        self.log.info("call ended (%s) after %.1f s of the caller's audio", reason,
                      self._received / SAMPLE_RATE)
        self.queue.close()
        if self._ending is None:
            self._ending = asyncio.get_running_loop().create_task(self.binding.end(f"sip {reason}"))


class SipAgent:
    """The SIP server's CallAcceptor: every accepted call gets a session, within the registry's
    limit. Lives as long as the server; the calls it made belong to themselves."""

    def __init__(self, settings: ServerSettings, registry: SessionRegistry,
                 pipeline: Callable[[], ModelPipeline | None], model_name: str) -> None:
        """``pipeline``: the serving pipeline now, or None while it loads or restarts."""
        self._settings = settings
        self._registry = registry
        self._pipeline = pipeline
        self._model_name = model_name

    def __call__(self, call: SipCallInfo, control: CallControl) -> SipSessionCall:
        pipeline = self._pipeline()
        if pipeline is None:
            raise CallRefused(503, "Service Unavailable", retry_after=5)
        session_call = SipSessionCall(call, control, self._settings, pipeline, self._registry,
                                      self._model_name)
        try:
            session_call.start()
        except TooManySessions as err:
            raise CallRefused(503, "Service Unavailable", retry_after=err.retry_after_s) from None
        return session_call
