"""The states of a session's turn state machine (``duplex.session.session``), and what a session
needs from its transport. A session owns one state and at most one barge-in sub-state at a time."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from duplex.session.barge_in import BackchannelCheck
from duplex.session.response import Response
from duplex.turns.server_vad import SpeechStopped


class SessionTransport(Protocol):
    kind: str  # metrics label: webrtc | websocket | sip | twilio

    def send_event(self, event: dict[str, Any]) -> None: ...


class State(enum.StrEnum):
    LISTENING = "listening"
    USER_SPEAKING = "user_speaking"
    THINKING = "thinking"
    SPEAKING = "speaking"


@dataclass
class PendingInterruption:
    """Speech over the agent, not yet confirmed; ``heard_ms`` is what was played before the pause.
    While its words are recognised (``check``), ``fragment_end`` is where the fragment ended (in
    samples) and ``stopped`` the turn end that came meanwhile, if any."""

    onset_ms: int
    heard_ms: int
    check: BackchannelCheck | None = None
    fragment_end: int = 0
    stopped: SpeechStopped | None = None


@dataclass
class Cancelling:
    """The response is being cancelled (and, after a barge-in, truncated to ``heard_ms``)."""

    response: Response
    heard_ms: int | None
    deferred_turn_end: float | None = None  # a turn that ended meanwhile: answered afterwards


BargeIn = PendingInterruption | Cancelling | None
