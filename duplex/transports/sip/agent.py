"""Phone calls answered by the agent: each accepted SIP call bound to a Session.

The module of ``sip/`` that knows the session layer (with ringing.py, which hands it a session
config). :class:`SipAgent` is the SIP server's acceptor: for each INVITE it admits a session
(``TooManySessions`` becomes a 503) and returns a :class:`SipSessionCall`. With a call webhook it
first lets the call ring while the app decides (ringing.py), then starts the session with the
config the app accepted it with. It also places calls (``dial``: the API's ``POST
/v1/realtime/calls`` with a ``target_uri``) through the server (dial.py), kept in its
:class:`~.outbound.OutboundCalls`; a call the callee answers gets its session exactly as an
incoming one does, with the config the app placed it with. The call's id, in the webhook, the
API and the logs, is :func:`session_id`. A :class:`SipSessionCall` carries the call's audio both
ways for its whole life:

- inbound: 8 kHz G.711, decoded by the stack to int16, resampled to the session's 16 kHz;
- outbound: the agent's voice through a ``PacedPlayout`` on an 8 kHz :class:`FrameQueue`, from
  which the stack's RTP sender pulls a 160-sample frame every 20 ms (``next_frame``): barge-in
  holds or flushes that queue, so the caller hears the agent stop within a frame;
- DTMF: each key press reaches the session (``Session.on_dtmf``);
- hold: the queue is paused while the caller holds (the stack suspends the inbound timeout);
- silence: a phone may stop sending RTP when the caller is quiet (VAD/DTX, comfort noise, or a
  test caller playing a file). Turn-taking runs on audio time, so a gap longer than
  ``GAP_FILL_AFTER_S`` is filled with silence on the 20 ms tick of the outbound sender.

A phone call has no events channel of its own: server events go to the recording's log, if any,
and to the call's sideband while one is attached (sideband.py: ``GET /v1/realtime?call_id=…``);
otherwise they are dropped (the session log keeps the story). A transfer (``refer``, the API's
``/refer``) reports its progress as server events (``call.transfer.progress``, then
``call.transfer.completed`` or ``call.transfer.failed``). Where the preset enables it
(``transfer_call:``), the call's model is offered the built-in ``transfer_call`` tool
(duplex/tools/transfer_call.py), whose calls the server runs through the same ``refer``: the call is
its :class:`~duplex.tools.transfer_call.TransferableCall`. The call ends once, whoever ends it:
``on_ended`` from the stack (BYE, CANCEL, media timeout, a completed transfer, server close) or
the server hanging up (registry, shutdown) through ``CallControl``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from duplex.media.frame_queue import FrameQueue
from duplex.media.pcm import pcm16_to_float
from duplex.media.playout import PacedPlayout
from duplex.media.resample import Resampler
from duplex.protocol.events import event, new_id
from duplex.registry import SessionRegistry, TooManySessions
from duplex.session.config import SessionConfig
from duplex.session.model_pipeline import ModelPipeline
from duplex.session.session import Session
from duplex.settings import ServerSettings
from duplex.tools.transfer_call import TransferCall, TransferImpossible
from duplex.transports.binding import Closing, SessionBinding
from duplex.transports.sip.dial import DialError, Dialling
from duplex.transports.sip.handler import (
    FRAME_SAMPLES,
    SAMPLE_RATE,
    CallControl,
    CallRefused,
    EndReason,
    InvalidTarget,
    ReferError,
    SipCallInfo,
)
from duplex.transports.sip.outbound import PLACING, DialledCall, OutboundCalls
from duplex.transports.sip.ringing import RingingCalls
from duplex.transports.sip.server import SipServer
from duplex.transports.sip.sideband import Sideband, SidebandInUse
from duplex.turns.vad import SAMPLE_RATE as SESSION_RATE

log = logging.getLogger(__name__)

GAP_FILL_AFTER_S = 0.1  # later than any jitter a packet of a live call arrives with
FRAME_S = FRAME_SAMPLES / SAMPLE_RATE
# A SIP Call-ID may hold "/", "?" and quotes (RFC 3261 §25.1 word): ids that travel in a URL path
# and name recordings keep to these characters, or are a hash of the Call-ID.
_SAFE_ID = re.compile(r"[A-Za-z0-9._~@+-]{1,128}\Z")


def session_id(sip_call_id: str) -> str:
    """The call's id for the API, the webhook, recordings and logs: ``sip_`` and the Call-ID, or
    its SHA-256 (32 hex digits) where the Call-ID does not fit in a URL path segment."""
    if _SAFE_ID.match(sip_call_id):
        return f"sip_{sip_call_id}"
    return f"sip_{hashlib.sha256(sip_call_id.encode()).hexdigest()[:32]}"


class SipSessionCall:
    """One phone call bound to a Session (see module doc); a CallMedia and a SessionTransport."""

    kind = "sip"

    def __init__(self, info: SipCallInfo, control: CallControl, settings: ServerSettings,
                 pipeline: ModelPipeline, registry: SessionRegistry, model_name: str) -> None:
        self.id = session_id(info.call_id)
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
        # The agent's, to drop it from its tables when it ends (given the stack's reason).
        self.forget: Callable[[EndReason], object] = lambda reason: None
        self.sideband: Sideband | None = None  # the app's WebSocket on the call, while attached
        self.log = logging.LoggerAdapter(log, {"session_id": self.id})
        # The built-in transfer_call tool, which the session offers its model and runs.
        self.server_function: TransferCall | None = None
        if settings.transfer_call.enabled:
            self.server_function = TransferCall(settings.transfer_call, self, {"session_id": self.id})
            # Offered beside the client's tools; the session runs the model's calls of it.
            self.session.server_function = self.server_function

    def start(self) -> None:
        """Admit the session (raises TooManySessions) and start it."""
        self.binding.admit()
        self.binding.start()
        self.log.info("call %s %s (%s, dtmf %s)", "to" if self.info.outbound else "from",
                      self.info.to_uri if self.info.outbound else self.info.from_uri,
                      self.info.codec, self.info.dtmf)

    def refer(self, target_uri: str,
              listener: Callable[[int, str, str], None] | None = None) -> None:
        """Transfer the call to ``target_uri`` (a REFER to the caller), reporting its progress as
        server events, then to ``listener(status, reason, outcome)`` if given; raises
        InvalidTarget or ReferError (handler.py). The API's ``/refer`` and ``transfer_call``."""
        def progress(status: int, reason: str, outcome: str) -> None:
            self._transfer_event(target_uri, status, reason, outcome)
            if listener is not None:
                listener(status, reason, outcome)

        self._control.refer(target_uri, progress)

    def transfer(self, target_uri: str, on_progress: Callable[[int, str, str], None]) -> None:
        """TransferableCall (duplex/tools/transfer_call.py): ``refer`` for the model's tool."""
        try:
            self.refer(target_uri, on_progress)
        except (InvalidTarget, ReferError) as err:
            raise TransferImpossible(str(err)) from None

    def _transfer_event(self, target_uri: str, status: int, reason: str, outcome: str) -> None:
        """The transfer's progress as server events (docs/operators.md names them)."""
        fields = {"call_id": self.id, "target_uri": target_uri, "status": status, "reason": reason}
        self.log.info("transfer to %s: %d %s (%s)", target_uri, status, reason, outcome)
        self.session.send(event("call.transfer.progress", **fields))
        if outcome != "pending":
            self.session.send(event(f"call.transfer.{outcome}", **fields))

    async def _hang_up(self, closing: Closing) -> None:
        self.log.info("hanging up: %s", closing.reason)
        self._control.hangup()  # the stack answers with on_ended("hangup")

    # --- SessionTransport --------------------------------------------------------------------

    def send_event(self, event: dict[str, Any]) -> None:
        """To the sideband, if one is attached (module doc)."""
        if self.sideband is not None:
            self.sideband.send(event)

    def attach(self, sideband: Sideband) -> None:
        """The app's sideband (sideband.py); raises SidebandInUse while another is attached."""
        if self.sideband is not None:
            raise SidebandInUse(f"call {self.id!r} has a sideband already")
        self.sideband = sideband

    def detach(self, sideband: Sideband) -> None:
        if self.sideband is sideband:
            self.sideband = None

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
        self.forget(reason)
        if self.server_function is not None:
            self.server_function.close()
        if self.sideband is not None:
            self.sideband.call_ended()
        if self._ending is None:
            self._ending = asyncio.get_running_loop().create_task(self.binding.end(f"sip {reason}"))


class SipAgent:
    """The SIP server's CallAcceptor: every accepted call gets a session, within the registry's
    limit. With ``ringing`` (a call webhook) the app decides on each call first. Lives as long as
    the server; the calls it made belong to themselves."""

    def __init__(self, settings: ServerSettings, registry: SessionRegistry,
                 pipeline: Callable[[], ModelPipeline | None], model_name: str,
                 ringing: RingingCalls | None = None) -> None:
        """``pipeline``: the serving pipeline now, or None while it loads or restarts."""
        self._settings = settings
        self._registry = registry
        self._pipeline = pipeline
        self._model_name = model_name
        self._ringing = ringing
        # The answered calls by id, from their start to their end (for /refer).
        self.live: dict[str, SipSessionCall] = {}
        self.outbound = OutboundCalls()  # the calls it placed (outbound.py)
        self.server: SipServer | None = None  # places its calls; set by serve.py once it exists

    def __call__(self, call: SipCallInfo,
                 control: CallControl) -> SipSessionCall | Awaitable[SipSessionCall]:
        if self._ringing is None:
            return self._answer(call, control, None)
        self._hold(session_id(call.call_id))
        return self._decided(call, control, self._ringing)

    async def dial(self, target_uri: str, config: SessionConfig,
                   ring_timeout_s: float) -> DialledCall:
        """Place a call to ``target_uri`` whose session, once the callee answers, runs with
        ``config``; returns as the INVITE leaves. Raises CallRefused (no room, no pipeline, the
        SIP server off or unable: 503), InvalidTarget (400) before anything is sent."""
        if self.server is None:
            raise CallRefused(503, "the SIP server is not running")
        # The slot is held from here until the callee answers (the session takes it) or the call
        # ends unanswered; dial() awaits before the call has its id, so the hold has its own key.
        hold = new_id("dial")
        self._hold(hold)

        def progress(dialling: Dialling) -> None:
            self.outbound.progress(session_id(dialling.call_id), dialling)
            if dialling.state not in PLACING:
                self._registry.unhold(hold)

        try:
            dialling = await self.server.dial(
                target_uri, lambda info, control: self._answer(info, control, config, hold),
                progress, ring_timeout_s)
        except DialError as err:
            self._registry.unhold(hold)
            raise CallRefused(503, str(err), retry_after=5) from None
        except BaseException:
            self._registry.unhold(hold)
            raise
        call = DialledCall(session_id(dialling.call_id), target_uri, dialling)
        self.outbound.add(call)
        return call

    def _hold(self, key: str) -> None:
        """Hold a session slot for a call that rings, or is placed, until its session starts or
        it ends unanswered (the registry's holds: no session of any transport takes it
        meanwhile); refuse the call where none is free or there is no pipeline."""
        if self._pipeline() is None:
            raise CallRefused(503, "Service Unavailable", retry_after=5)
        try:
            self._registry.hold(key, "sip")
        except TooManySessions as err:
            raise CallRefused(503, "Service Unavailable", retry_after=err.retry_after_s) from None

    async def _decided(self, call: SipCallInfo, control: CallControl,
                       ringing: RingingCalls) -> SipSessionCall:
        """Ring while the app decides (ringing.py), then answer with the config it accepted."""
        hold = session_id(call.call_id)  # held by __call__
        try:
            with ringing.ringing(hold, call) as waiting:
                control.ring()
                config = await ringing.decision(waiting)
                try:
                    session_call = self._answer(call, control, config, hold)
                except CallRefused as refused:  # the pipeline restarts
                    waiting.answered.set_result(refused)
                    raise
                waiting.answered.set_result(None)
                return session_call
        finally:
            self._registry.unhold(hold)

    def _answer(self, call: SipCallInfo, control: CallControl,
                config: SessionConfig | None, hold: str | None = None) -> SipSessionCall:
        """Start the call's session (with ``config``), in the slot ``hold`` kept for it, if any."""
        pipeline = self._pipeline()
        if pipeline is None:
            raise CallRefused(503, "Service Unavailable", retry_after=5)
        session_call = SipSessionCall(call, control, self._settings, pipeline, self._registry,
                                      self._model_name)
        if config is not None:
            session_call.session.reconfigure(config)
        if hold is not None:
            self._registry.unhold(hold)  # the session takes it now: nothing runs in between
        try:
            session_call.start()
        except TooManySessions as err:
            raise CallRefused(503, "Service Unavailable", retry_after=err.retry_after_s) from None
        self.live[session_call.id] = session_call
        session_call.forget = lambda reason: self._forget(session_call.id, reason)
        return session_call

    def _forget(self, call_id: str, reason: EndReason) -> None:
        self.live.pop(call_id, None)
        self.outbound.ended(call_id, reason)
