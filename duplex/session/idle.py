"""Idle and length limits of one call: OpenAI's ``idle_timeout_ms``, the check-ins a preset asks
when the caller goes quiet, and the longest a call may last.

- Idle timeout (``turn_detection.idle_timeout_ms``): once the agent's audio has finished playing
  (the response is done: the paced transports drain their audio first; where the client plays it,
  the audio it still had to play counts) and the caller has been silent that long,
  ``input_audio_buffer.timeout_triggered`` goes out (``audio_start_ms``: where the silence began,
  ``audio_end_ms``: now, ``item_id``: the item committed for it), the silence is committed as a
  user item (a second of it at most: the model needs no more to hear nothing) and a response is
  created, as OpenAI does. Never while a response is in flight or the caller speaks.
- Check-ins (the preset's ``check_ins`` > 0): that response says ``check_in_text``; after
  ``check_ins`` check-ins in a row the caller did not answer, the next timeout ends the call with
  ``idle_goodbye_text``. Any speech of the caller answers (the count restarts).
- Longest call (``max_call_s``, or a call's own shorter :meth:`Idle.limit_call`): the response
  in flight is cancelled, the agent says ``closing_text``, and the call is hung up.

The agent's own lines (a check-in, a goodbye, a closing line) are responses whose instructions say
to speak that text and whose request gives it (``params["say"]``): a model that speaks given
words (the offline preset's) says it exactly; others are asked to. Ending a call: once the closing
line's ``response.done`` went out (its audio played, or cut by the caller), :attr:`Idle.hang_up`
ends the call on its transport (the binding sets it: a BYE, a WebSocket close, the peer's close).

Time: the silence and the call's length run on audio time (the position of the caller's stream,
like every turn decision), so the same audio gives the same decisions. Where the binding started
the limits (:meth:`Idle.start`), the call's length is also checked on the monotonic clock, so a
call whose audio stopped still ends.

Lifetime: one per session, made with it and closed by ``Session.close`` (:meth:`Idle.close`):
its timer, its closing task and the hang-up callback (the binding's) are dropped then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from duplex.media.playout import AgentAudio
from duplex.protocol.events import RealtimeError, event, new_id
from duplex.protocol.response_create import ResponseSpec
from duplex.turns.vad import SAMPLE_RATE

if TYPE_CHECKING:
    from duplex.session.config import SessionConfig
    from duplex.session.response import Response
    from duplex.settings import SessionDefaults

log = logging.getLogger(__name__)

MAX_COMMITTED_SILENCE_MS = 1000
# A closing line that never ends (a stuck pipeline) must not keep the call: hang up after this.
CLOSING_LINE_LIMIT_S = 30.0
# The response in flight when a call must end is cancelled; OpenAI's reasons have none for the
# server ending a call, so it reads as the client's (the operator's) cancel.
CANCEL_REASON = "client_cancelled"


class IdleHost(Protocol):
    """What the limits need from their session."""

    config: SessionConfig
    audio: AgentAudio

    @property
    def response(self) -> Response | None: ...

    @property
    def barge_in(self) -> Any: ...

    @property
    def closed(self) -> bool: ...

    def send(self, message: dict[str, Any]) -> None: ...

    def commit_user_audio(self, item_id: str, audio: np.ndarray) -> None: ...

    def start_response(self, turn_end_at: float | None = None, spec: ResponseSpec | None = None) -> None: ...

    async def cancel_response(self, reason: str, response_id: str | None = None) -> bool: ...


def say_exactly(instructions: str, text: str) -> str:
    """Instructions for a response that says ``text`` and nothing else."""
    return f'{instructions}\n\nNow say exactly this, and nothing more: "{text}"'


class Idle:
    """See module doc. ``hang_up(reason)`` ends the call; None (a session without a binding, or
    once closed): the end is only logged."""

    def __init__(self, host: IdleHost, defaults: SessionDefaults,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._host = host
        self._defaults = defaults
        self._clock = clock
        self.hang_up: Callable[[str], None] | None = None
        self._max_call_ms: float | None = None if defaults.max_call_s is None else defaults.max_call_s * 1000
        self._started_at: float | None = None  # clock time of start(); None: audio time only
        self._timer: asyncio.TimerHandle | None = None
        self._position = 0  # the caller's stream, ms (the last window seen)
        self._since = 0  # where the current silence began, ms
        self._unanswered = 0  # check-ins in a row without an answer
        self.ending: str | None = None  # why the call is being ended, once it is
        self._closing: Response | None = None  # the response saying the closing line
        self._closing_done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def unanswered(self) -> int:
        return self._unanswered

    def start(self, hang_up: Callable[[str], None]) -> None:
        """The call began: how to end it, and a timer for its longest length on the clock."""
        self.hang_up = hang_up
        self._started_at = self._clock()
        self._arm()

    def limit_call(self, seconds: float) -> None:
        """This call's own limit (a session config that allows it); it can only shorten the
        preset's."""
        ms = seconds * 1000
        self._max_call_ms = ms if self._max_call_ms is None else min(self._max_call_ms, ms)
        self._arm()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._started_at is None or self._max_call_ms is None:
            return
        left = self._max_call_ms / 1000 - (self._clock() - self._started_at)
        self._timer = asyncio.get_running_loop().call_later(max(left, 0.0), self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer = None
        if self.ending is None and not self._host.closed:
            self.end_call(self._defaults.closing_text, "the call reached its maximum length")

    def _elapsed_ms(self) -> float:
        wall = 0.0 if self._started_at is None else (self._clock() - self._started_at) * 1000
        return max(float(self._position), wall)

    # --- the session's feed -------------------------------------------------------------------

    def step(self, position_ms: int, in_speech: bool) -> None:
        """One window of the caller's audio was heard (``position_ms``: the stream's end)."""
        self._position = position_ms
        host = self._host
        if self.ending is not None or host.closed:
            return
        if self._max_call_ms is not None and self._elapsed_ms() >= self._max_call_ms:
            self.end_call(self._defaults.closing_text, "the call reached its maximum length")
            return
        if in_speech:
            self._unanswered = 0  # the caller answered (or spoke up by themselves)
        if in_speech or host.response is not None or host.barge_in is not None:
            self._since = max(self._since, position_ms)
            return
        td = host.config.turn_detection
        if td is None or td.idle_timeout_ms is None:
            return
        if position_ms - self._since >= td.idle_timeout_ms:
            self._timed_out(td.create_response)

    def response_done(self, response: Response) -> None:
        """``response.done`` went out: the silence counts from the end of its audio."""
        if self._host.closed:
            return
        if response is self._closing:
            self._closing_done.set()
            return
        left_ms = 0
        if not self._host.audio.paces_playout and response.playout_started_at is not None:
            # The client plays what it was sent in real time from its first chunk.
            played = (time.monotonic() - response.playout_started_at) * 1000
            left_ms = max(0, int(response.audio_ms - played))
        self._since = max(self._since, self._position + left_ms)

    def _timed_out(self, create_response: bool) -> None:
        host, start, end = self._host, self._since, self._position
        item_id = new_id("item")
        host.send(event("input_audio_buffer.timeout_triggered", audio_start_ms=start,
                        audio_end_ms=end, item_id=item_id))
        self._since = end
        checking = self._defaults.check_ins > 0
        if checking and self._unanswered >= self._defaults.check_ins:
            log.info("no answer to %d check-ins: ending the call", self._unanswered)
            self.end_call(self._defaults.idle_goodbye_text, "the caller did not answer the check-ins")
            return
        silence = min(end - start, MAX_COMMITTED_SILENCE_MS) * SAMPLE_RATE // 1000
        host.commit_user_audio(item_id, np.zeros(silence, dtype=np.float32))
        if checking:
            self._unanswered += 1
            self._say(self._defaults.check_in_text)
        elif create_response:
            host.start_response(turn_end_at=time.monotonic())

    def _say(self, text: str) -> Response | None:
        host = self._host
        spec = ResponseSpec.of_session(host.config)
        host.start_response(spec=replace(spec, instructions=say_exactly(spec.instructions, text),
                                         say=text))
        return host.response

    # --- the end of a call --------------------------------------------------------------------

    def end_call(self, closing_line: str, reason: str) -> None:
        """Say ``closing_line`` (after cancelling the response in flight), then hang up. Once."""
        if self.ending is not None:
            return
        self.ending = reason
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._close_call(closing_line, reason))

    async def _close_call(self, closing_line: str, reason: str) -> None:
        host = self._host
        try:
            if host.response is not None:
                while host.response is not None and not host.closed:
                    await host.cancel_response(CANCEL_REASON)
                host.audio.clear()  # a cancel keeps the queued audio (as OpenAI's response.cancel)
            if host.closed:
                return
            try:
                self._closing = self._say(closing_line)
            except RealtimeError:  # a response began meanwhile: the call ends without the line
                self._closing = None
            if self._closing is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing_done.wait(), CLOSING_LINE_LIMIT_S)
        finally:
            self._closing = None
        log.info("hanging up: %s", reason)
        if self.hang_up is not None:
            self.hang_up(reason)

    def close(self) -> None:
        """The session closed: no timer, no closing task, no way back to the binding."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task = self._task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        self._task = None
        self.hang_up = None
        self._host = _CLOSED  # the session owns this: no reference back to it (Session._let_go)


class _ClosedHost:
    """What a closed Idle refers to instead of its session: a host that is closed."""

    closed = True


_CLOSED: Any = _ClosedHost()
