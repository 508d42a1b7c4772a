"""Phone calls over SIP (RFC 3261, UDP) with G.711 RTP media, independent of the session layer.

A :class:`SipServer` answers INVITEs and hands each accepted call's audio to a
:class:`CallMedia` that its :class:`CallAcceptor` returns (see handler.py for the contract).
Modules, one job each: message (SIP parsing), transaction (timers, responses), sdp (offer/answer),
rtp (packets, DTMF), jitter (reordering), media (a call's RTP sockets and pacing), call (a dialog),
server (the UDP socket and dispatch).
"""

from .handler import (
    FRAME_SAMPLES,
    SAMPLE_RATE,
    CallAcceptor,
    CallControl,
    CallMedia,
    CallRefused,
    EndReason,
    SipCallInfo,
)
from .server import SipConfig, SipServer
from .transaction import SipTimers

__all__ = [
    "FRAME_SAMPLES", "SAMPLE_RATE", "CallAcceptor", "CallControl", "CallMedia", "CallRefused",
    "EndReason", "SipCallInfo", "SipConfig", "SipServer", "SipTimers",
]
