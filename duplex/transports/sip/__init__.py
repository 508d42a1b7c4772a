"""Phone calls over SIP (RFC 3261, UDP) with G.711 RTP media, independent of the session layer.

A :class:`SipServer` answers INVITEs and hands each accepted call's audio to a
:class:`CallMedia` that its :class:`CallAcceptor` returns (see handler.py for the contract).
Modules, one job each: message (SIP parsing), transaction (timers, responses), sdp (offer/answer),
rtp (packets, DTMF), jitter (reordering), media (a call's RTP sockets and pacing), call (a dialog),
refer (a transfer: REFER and its NOTIFYs), dial (a call we place: the INVITE we send until it is
answered), server (the UDP socket and dispatch). Above the stack: agent (calls answered, or placed,
by the agent's sessions), ringing (calls that ring while the operator's app decides), webhook (the
signed ``realtime.call.incoming`` POST that asks it), outbound (the calls the agent placed, for the
API) and sideband (a call's events over the app's WebSocket).
"""

from .handler import (
    FRAME_SAMPLES,
    SAMPLE_RATE,
    CallAcceptor,
    CallControl,
    CallMedia,
    CallRefused,
    EndReason,
    InvalidTarget,
    ReferError,
    SipCallInfo,
)
from .server import SipConfig, SipServer
from .transaction import SipTimers

__all__ = [
    "FRAME_SAMPLES", "SAMPLE_RATE", "CallAcceptor", "CallControl", "CallMedia", "CallRefused",
    "EndReason", "InvalidTarget", "ReferError", "SipCallInfo", "SipConfig", "SipServer", "SipTimers",
]
