"""Barge-in: speech over the agent while a response runs, the sub-state of a session's turn state
machine (:mod:`duplex.session.session`) while ``interrupt_response`` is on.

Where the client plays the audio (WebSocket), onset is at once a confirmed interruption:
``speech_started`` goes out so the client stops playing, and the response is cancelled. Where the
server paces the audio (WebRTC, SIP, Twilio's marks):

1. speech onset holds the agent's audio at once (no event): :class:`PendingInterruption`;
2. speech that lasts ``interrupt_min_speech_ms`` confirms it: ``speech_started`` (with the real
   onset), the queued audio cleared (``output_audio_buffer.cleared`` on paced transports), and
   :class:`Cancelling`: the pipeline request is aborted and acknowledged, ``response.done``
   (cancelled), ``conversation.item.truncated`` with the audio the user heard before the pause; the
   speech goes on as the user's next turn, and a turn that ends meanwhile is answered once the
   cancel is over (``Cancelling.deferred_turn_end``);
3. silence before that (a cough, a click) is a false interruption: the audio resumes where it
   paused and the fragment is discarded.

Where the preset listens for backchannels (``backchannel_max_ms``), speech shorter than that is
recognised first and the agent goes on after "mhm" or "yeah" as after a cough; only other words,
or longer speech, confirm the interruption (:mod:`duplex.session.barge_in`). A response that ends
while speech holds its audio (cancelled, cleared, failed) leaves nothing to interrupt: the held
audio is dropped and the hold lifted, and the speech is the user's.

An :class:`Interruptions` belongs to one session and lives as long as it; it holds the sub-state
(``state``) and the session's turn detector, and no reference to the session itself: the session
passes itself (an :class:`InterruptionHost`) to each call, so that a closed session is freed by
reference counting (see ``Session._let_go``). ``close`` drops the sub-state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import numpy as np

from duplex import metrics
from duplex.media.playout import AgentAudio
from duplex.session.barge_in import BackchannelCheck, Step, next_step
from duplex.session.config import SessionConfig
from duplex.session.conversation import Conversation
from duplex.session.model_pipeline import ModelPipeline
from duplex.session.response import Response
from duplex.session.states import BargeIn, Cancelling, PendingInterruption
from duplex.settings import SessionDefaults
from duplex.turns.server_vad import SpeechStarted, SpeechStopped, TurnDetector
from pipeline.proto import OmniRequest


class InterruptionHost(Protocol):
    """What barge-in needs from its session."""

    id: str
    audio: AgentAudio
    pipeline: ModelPipeline
    defaults: SessionDefaults
    config: SessionConfig
    conversation: Conversation
    log: logging.LoggerAdapter[Any]

    @property
    def response(self) -> Response | None:
        """The conversation's response in flight."""

    @property
    def closed(self) -> bool: ...

    def speech_started(self, onset_ms: int) -> None:
        """The user's speech began at ``onset_ms``: ``speech_started`` goes out."""

    def turn_ended(self, stop: SpeechStopped) -> None:
        """The user's turn ended (committed, and answered where turn detection answers)."""

    def answer_turn(self, turn_end_at: float) -> None:
        """Answer the turn that ended at ``turn_end_at`` (a deferred turn, after a cancel)."""

    def recognition(self, fragment: np.ndarray) -> OmniRequest:
        """The request that transcribes ``fragment``, speech over the agent."""


class Interruptions:
    """One session's barge-in sub-state (module doc)."""

    def __init__(self, detector: TurnDetector) -> None:
        self._detector = detector
        self.state: BargeIn = None

    def interruptible(self, host: InterruptionHost) -> bool:
        td = host.config.turn_detection
        return (host.response is not None and not isinstance(self.state, Cancelling)
                and td is not None and td.interrupt_response)

    def on_onset(self, host: InterruptionHost, onset: SpeechStarted, arrived_at: float) -> None:
        """Speech began (``arrived_at``: when the audio holding the onset arrived, monotonic)."""
        pending = self.state
        if isinstance(pending, PendingInterruption) and pending.check is not None:
            self._confirm(host, pending)  # speaking again after the fragment: no backchannel
        if not self.interruptible(host) or self.state is not None:
            host.speech_started(onset.start_ms)
            return
        pending = PendingInterruption(onset.start_ms, host.audio.heard_ms())
        if not host.audio.paces_playout:
            # The client plays the audio: nothing to hold here, so speech_started goes out now
            # (the client stops playing at once) and the response is cancelled (as OpenAI does).
            self._confirm(host, pending)
            return
        host.audio.pause()
        self.state = pending
        # From the arrival of the audio that holds the onset, so the VAD's own delay counts.
        metrics.BARGE_IN_STOP_SECONDS.observe(time.monotonic() - arrived_at)
        host.log.info("possible interruption at %d ms: agent audio paused", onset.start_ms)

    def check(self, host: InterruptionHost) -> None:
        """After each VAD window: confirm, dismiss or recognise the speech that holds the audio."""
        pending = self.state
        if not isinstance(pending, PendingInterruption):
            return
        step = next_step(self._detector, host.defaults, pending.check is not None)
        if step is Step.CONFIRM:
            self._confirm(host, pending)
        elif step is Step.DISMISS:
            if self._detector.in_speech:
                self._detector.discard_turn()
            self._false_interruption(host)
        elif step is Step.RECOGNISE:
            pending.fragment_end = self._detector.pause_start
            pending.check = BackchannelCheck(
                host.pipeline, host.recognition(self._detector.turn_audio()),
                lambda verdict: self._on_backchannel_verdict(host, pending, verdict), {"session_id": host.id})

    def on_turn_end(self, host: InterruptionHost, stop: SpeechStopped) -> bool:
        """The user's turn ended: True where the speech over the agent takes it (its words, or
        its silence, decide what it was)."""
        pending = self.state
        if not isinstance(pending, PendingInterruption):
            return False
        if pending.check is None:
            self._false_interruption(host)
        else:
            pending.stopped = stop  # its words decide what the turn was
        return True

    def defer(self, turn_end_at: float) -> None:
        """A turn ended while a response runs: answered after the cancel, where it is cancelled."""
        if isinstance(self.state, Cancelling):
            self.state.deferred_turn_end = turn_end_at

    async def cancel(self, host: InterruptionHost, resp: Response, reason: str,
                     heard_ms: int | None = None) -> None:
        """Cancel ``resp``, the conversation's response, and wait until its response.done went out;
        with ``heard_ms``, cut it to what the user heard as a barge-in does (a dropped connection)."""
        if isinstance(self.state, Cancelling) and self.state.response is resp:
            await resp.cancel(reason)  # already being cancelled: wait for it
            return
        self._begin_cancel(host, resp, heard_ms)
        await self._finish_cancel(host, reason)

    def response_done(self, host: InterruptionHost) -> None:
        """The conversation's response is over: speech that held its audio holds it no more."""
        held = self.state
        if isinstance(held, PendingInterruption):
            self.state = None
            self._release_hold(host, held)

    def close(self) -> None:
        """The session closed: a pending backchannel check (it calls back) and the sub-state go."""
        if isinstance(self.state, PendingInterruption) and self.state.check is not None:
            self.state.check.cancel()
        self.state = None

    def _on_backchannel_verdict(self, host: InterruptionHost, pending: PendingInterruption,
                                backchannel: bool | None) -> None:
        if self.state is not pending or host.closed:
            return
        went_on = self._detector.in_speech and self._detector.pause_start > pending.fragment_end
        if not backchannel or went_on:
            self._confirm(host, pending)
            return
        if pending.stopped is None:
            self._detector.discard_turn()
        self._false_interruption(host)

    def _false_interruption(self, host: InterruptionHost) -> None:
        self.state = None
        host.audio.resume()
        host.log.info("false interruption: agent audio resumed")

    def _confirm(self, host: InterruptionHost, pending: PendingInterruption) -> None:
        resp = host.response
        self.state = None
        if pending.check is not None:
            pending.check.cancel()
        metrics.BARGE_INS_TOTAL.inc()
        host.log.info("interruption confirmed; the user heard %d ms", pending.heard_ms)
        host.speech_started(pending.onset_ms)
        if resp is None:
            return
        host.audio.clear()
        host.audio.resume()
        self._begin_cancel(host, resp, pending.heard_ms)
        asyncio.get_running_loop().create_task(self._finish_cancel(host, "turn_detected"))
        if pending.stopped is not None:
            host.turn_ended(pending.stopped)  # the fragment is the next turn: answered after the cancel

    def _begin_cancel(self, host: InterruptionHost, resp: Response, heard_ms: int | None) -> Cancelling:
        held = self.state
        if not isinstance(held, Cancelling) or held.response is not resp:
            self.state = Cancelling(resp, heard_ms)
            if isinstance(held, PendingInterruption):
                self._release_hold(host, held)
        return self.state

    def _release_hold(self, host: InterruptionHost, pending: PendingInterruption) -> None:
        """Speech held the agent's audio and its response ended (cancelled, cleared, failed, done):
        nothing is left to interrupt. The audio it held is dropped (its answer is over) and the
        hold lifted, or the next answer would be queued silent behind it; the speech is the
        user's, as any speech while no response runs (and its end, if it came, their turn's)."""
        if pending.check is not None:
            pending.check.cancel()
        host.log.info("the held response ended: agent audio released")
        if host.audio.queued_seconds() > 0:
            host.audio.clear()
        host.audio.resume()
        host.speech_started(pending.onset_ms)
        if pending.stopped is not None:
            host.turn_ended(pending.stopped)

    async def _finish_cancel(self, host: InterruptionHost, reason: str) -> None:
        """Cancel the response of the Cancelling sub-state, truncate it, answer a deferred turn."""
        cancelling = self.state
        assert isinstance(cancelling, Cancelling)
        try:
            await cancelling.response.cancel(reason, cancelling.heard_ms)
            if cancelling.heard_ms is not None:
                host.conversation.truncate(cancelling.response.item, cancelling.heard_ms)
        finally:
            if self.state is cancelling:
                self.state = None
        if cancelling.deferred_turn_end is not None and not host.closed and host.response is None:
            host.answer_turn(cancelling.deferred_turn_end)
