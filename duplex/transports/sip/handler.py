"""The interface between the SIP stack and whatever answers the calls (the agent's session).

The stack knows nothing of sessions. For each new INVITE it calls the server's ``accept``
(:class:`CallAcceptor`) with the call's :class:`SipCallInfo` and a :class:`CallControl`; the
acceptor returns the call's :class:`CallMedia` or raises :class:`CallRefused`. It may return an
awaitable and take its time (``CallControl.ring`` tells the caller it rings meanwhile): when the
call ends before it decides (the caller's CANCEL, the server closing), the stack cancels that
awaitable, so whatever the acceptor holds for the undecided call is let go in its ``finally``.
From then on, until ``on_ended``, the stack drives the media object from the event loop:

- ``on_audio`` with each inbound packet decoded to 8 kHz int16 (160 samples for the usual 20 ms
  packets; lost packets concealed with silence, so the timeline has no holes);
- ``next_frame`` every 20 ms on the monotonic clock, for the next 160 samples to send (``None``:
  nothing to say, the stack sends silence). Barge-in is simply: return ``None`` from now on;
- ``on_dtmf`` once per RFC 4733 key press, ``on_hold`` when the peer holds / resumes;
- ``on_ended`` exactly once, whoever ended the call; after it nothing is called again.

All callbacks run on the event loop and must not block. The media object and everything it holds
belong to the one call and can be dropped after ``on_ended``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

SAMPLE_RATE = 8000
FRAME_SAMPLES = 160  # 20 ms at 8 kHz: one RTP packet each way

EndReason = Literal[
    "bye",  # the peer hung up
    "hangup",  # the media object asked for it (CallControl.hangup)
    "cancelled",  # the peer cancelled the INVITE before we answered
    "media-timeout",  # no RTP from the peer for the inbound-media timeout
    "no-ack",  # the peer never acknowledged our 200 OK
    "bad-sdp",  # the peer's answer in an ACK was unusable (RFC 3264 leaves only a BYE)
    "server-closed",  # SipServer.close()
    "transferred",  # the transfer target answered the caller (REFER, then a 2xx NOTIFY)
]


@dataclass(frozen=True)
class SipCallInfo:
    """What is known of a call when it is offered (immutable; the negotiated codec included)."""

    call_id: str
    peer: tuple[str, int]  # where the INVITE came from
    from_uri: str  # the caller (From)
    to_uri: str  # who was called (To / the dialled number)
    codec: str  # "PCMU" or "PCMA" (the audio on the wire; the media object sees PCM only)
    dtmf: bool  # whether RFC 4733 telephone events were negotiated
    local_rtp: tuple[str, int]  # our RTP address as advertised in the answer
    remote_rtp: tuple[str, int]  # the peer's RTP address from its offer
    # The INVITE's headers as received (a call we placed: its 2xx's), in order, names in their
    # usual spelling ("Call-ID").
    headers: tuple[tuple[str, str], ...] = ()
    outbound: bool = False  # we placed the call (dial.py): from_uri is ours, to_uri the callee


class CallRefused(Exception):
    """Raised by the acceptor to decline a call with a SIP status (503 gets Retry-After)."""

    def __init__(self, status: int = 503, reason: str = "Service Unavailable",
                 retry_after: int | None = None) -> None:
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


class ReferError(Exception):
    """A transfer that cannot be started (the call is not answered, or one is under way)."""


class InvalidTarget(ValueError):
    """A transfer's target is no sip:, sips: or tel: URI the stack would put in a header."""


class CallControl(Protocol):
    """The stack's side of one call, handed to the acceptor."""

    @property
    def call_id(self) -> str: ...

    def hangup(self) -> None:
        """End the call with a BYE; ``on_ended("hangup")`` follows at once. Idempotent.

        Called inside ``accept``, it declines the INVITE (603) and ``on_ended`` reaches the
        media object as soon as ``accept`` returns it."""

    def ring(self) -> None:
        """While ``accept`` decides: answer the INVITE with 180 Ringing (nothing once answered)."""

    def refer(self, target_uri: str, on_progress: Callable[[int, str, str], None]) -> None:
        """Transfer the answered call: a REFER (RFC 3515) to the caller naming ``target_uri``
        (refer.py). ``on_progress(status, reason, outcome)`` gets the REFER's own final answer
        (202, or the refusal) and then each NOTIFY's sipfrag status line, ``outcome`` being
        "pending", "completed" or "failed"; after a 2xx sipfrag the stack ends the call with a BYE
        ("transferred"). Raises :class:`InvalidTarget` when ``target_uri`` is no sip:, sips:
        or tel: URI, :class:`ReferError` when the call is not answered or a transfer is already
        under way."""


class CallMedia(Protocol):
    """One call's audio endpoint on the other side of the stack (see module doc)."""

    def on_audio(self, pcm: np.ndarray, arrival: float) -> None:
        """``pcm``: int16 8 kHz mono, one packet's worth (160 samples at the usual 20 ms);
        ``arrival``: time.monotonic() when the packet came in."""

    def on_dtmf(self, digit: str) -> None:
        """One of ``0123456789*#ABCD``."""

    def on_hold(self, held: bool) -> None:
        """The peer held (no audio is sent or expected) or resumed the call."""

    def next_frame(self) -> np.ndarray | None:
        """The next 160 int16 samples to send, or None for silence."""

    def on_ended(self, reason: EndReason) -> None:
        """The call is over (see :data:`EndReason`)."""


class CallAcceptor(Protocol):
    """Decides on a new call: returns its media (possibly awaitably) or raises CallRefused."""

    def __call__(self, call: SipCallInfo,
                 control: CallControl) -> CallMedia | Awaitable[CallMedia]: ...
