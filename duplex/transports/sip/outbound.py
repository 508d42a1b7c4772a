"""Calls the agent places (``POST /v1/realtime/calls`` with a ``target_uri``): what the API tells of each.

The agent (agent.py) places a call through the SIP server (dial.py) and keeps a :class:`DialledCall`
for it here, which the stack's progress reports keep current:

``dialing`` (INVITE sent) → ``ringing`` (180/183) → ``active`` (answered: the agent's session runs)
→ ``ended``; or, before an answer, ``failed`` (the callee's 3xx-6xx, no response at all: 408, or an
answer the server could not take), ``cancelled`` (the app hung up: CANCEL) or ``no_answer`` (the
ring timeout: CANCEL). ``sip_status`` and ``reason`` are the latest SIP status and why it ended.

A call being placed holds a session slot (the registry's ``hold``, agent.py) from its INVITE until
its session takes it or it ends unanswered. :class:`OutboundCalls` lives as long as the server; it keeps the calls being
placed or live, and the last :data:`KEPT` that are over (for ``GET /v1/realtime/calls/{id}``),
dropping older ones as new calls come: a bounded table whatever the number of calls.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .dial import Dialling

KEPT = 256  # finished calls kept for the API
PLACING = frozenset({"dialing", "ringing"})
LIVE = PLACING | {"active"}


@dataclass
class DialledCall:
    """One call the agent placed (module doc)."""

    id: str  # the call's id in the API, the sideband, logs and recordings (agent.session_id)
    target_uri: str
    dialling: Dialling | None  # the stack's INVITE until it is answered or over
    state: str = "dialing"
    sip_status: int | None = None
    reason: str | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))
    # Set once the call is answered or over without an answer (a sideband opened early waits).
    placed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.call", "direction": "outbound",
                "target_uri": self.target_uri, "state": self.state,
                "sip_status": self.sip_status, "reason": self.reason,
                "created_at": self.created_at}


class OutboundCalls:
    """The agent's placed calls by id (module doc)."""

    def __init__(self) -> None:
        self._calls: OrderedDict[str, DialledCall] = OrderedDict()

    def get(self, call_id: str) -> DialledCall | None:
        return self._calls.get(call_id)

    def add(self, call: DialledCall) -> None:
        self._calls[call.id] = call
        over = [key for key, kept in self._calls.items() if kept.state not in LIVE]
        for key in over[:max(len(over) - KEPT, 0)]:
            del self._calls[key]

    def progress(self, call_id: str, dialling: Dialling) -> None:
        """The stack's report on the INVITE (dial.py's states; ``answered`` is ``active`` here)."""
        call = self._calls.get(call_id)
        if call is None:
            return
        call.state = "active" if dialling.state == "answered" else dialling.state
        call.sip_status, call.reason = dialling.status, dialling.reason or None
        if dialling.done:
            call.dialling = None
            call.placed.set()

    def ended(self, call_id: str, reason: str) -> None:
        """The answered call is over (``reason``: the stack's EndReason)."""
        call = self._calls.get(call_id)
        if call is not None:
            call.state, call.reason = "ended", reason
