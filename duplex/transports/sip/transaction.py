"""SIP transactions over UDP (RFC 3261 §17): retransmission timers and response building.

- :class:`Retransmitter` resends one datagram on the T1-doubling-to-T2 schedule (timer G for our
  final responses to INVITE, timer E for our BYE) until stopped or until 64*T1 (timers H / F);
  timer A, for an INVITE we send, doubles without the T2 cap (§17.1.1.2).
- :func:`response` builds a response to a request: its Vias, From, To (with our tag), Call-ID and
  CSeq copied, the top Via marked with where the request really came from (RFC 3261 §18.2.1,
  RFC 3581 rport), since responses go back to that source address.

A Retransmitter belongs to the transaction that created it (the server's table or a call) and is
stopped by it; every one of them ends by itself after 64*T1 at the latest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from .message import SipMessage, params

REASONS = {
    100: "Trying", 180: "Ringing", 200: "OK", 202: "Accepted", 400: "Bad Request",
    401: "Unauthorized", 402: "Payment Required", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 406: "Not Acceptable", 408: "Request Timeout", 410: "Gone",
    415: "Unsupported Media Type", 416: "Unsupported URI Scheme", 420: "Bad Extension",
    480: "Temporarily Unavailable", 481: "Call/Transaction Does Not Exist", 482: "Loop Detected",
    484: "Address Incomplete", 486: "Busy Here", 487: "Request Terminated",
    488: "Not Acceptable Here", 489: "Bad Event", 500: "Server Internal Error",
    501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable",
    504: "Server Time-out", 505: "Version Not Supported", 600: "Busy Everywhere", 603: "Decline",
    604: "Does Not Exist Anywhere", 606: "Not Acceptable",
}
ALLOW = "INVITE, ACK, BYE, CANCEL, OPTIONS, NOTIFY"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SipTimers:
    """RFC 3261 §17.1.1.1 T1 and T2 (tests shrink them to run timeouts in seconds)."""

    t1: float = 0.5
    t2: float = 4.0

    @property
    def timeout(self) -> float:
        """64*T1: timers B, F, H, J (32 s by default)."""
        return 64 * self.t1


class Retransmitter:
    """Send now, then again after T1, 2*T1, ... capped at T2, until ``stop`` or 64*T1.

    ``on_timeout`` runs (once) when 64*T1 passes without ``stop``.
    """

    def __init__(self, send: Callable[[], None], timers: SipTimers,
                 on_timeout: Callable[[], None] | None = None, capped: bool = True) -> None:
        """``capped=False``: the interval keeps doubling past T2 (timer A, our INVITEs)."""
        self._send = send
        self._timers = timers
        self._on_timeout = on_timeout
        self._cap = timers.t2 if capped else float("inf")
        self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def running(self) -> bool:
        return not self._task.done()

    def stop(self) -> None:
        self._task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._timers.timeout
        interval = self._timers.t1
        self._send()
        while True:
            wait = min(interval, give_up - loop.time())
            if wait <= 0:
                break
            await asyncio.sleep(wait)
            if loop.time() >= give_up:
                break
            self._send()
            interval = min(interval * 2, self._cap)
        if self._on_timeout is not None:
            try:
                self._on_timeout()
            except Exception:  # a timeout handler must not kill the loop's task silently
                log.exception("transaction timeout handler failed")

    async def wait(self) -> None:
        """Until stopped or timed out."""
        try:
            await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if not self._task.cancelled():
                raise


def response(request: SipMessage, status: int, source: tuple[str, int], *,
             to_tag: str | None = None, reason: str | None = None,
             headers: list[tuple[str, str]] | None = None, body: bytes = b"",
             content_type: str | None = None) -> SipMessage:
    """A response to ``request`` (see module doc). ``to_tag`` is added when To has none."""
    out = SipMessage(status=status, reason=reason or REASONS.get(status, "Unknown"))
    vias = request.get_all("via")
    for index, via in enumerate(vias):
        out.headers.append(("via", _mark_source(via, source) if index == 0 else via))
    for name in ("from", "to", "call-id", "cseq"):
        value = request.get(name)
        if value is None:
            continue
        if name == "to" and to_tag and status > 100 and "tag" not in params(value):
            value = f"{value};tag={to_tag}"
        out.headers.append((name, value))
    out.headers.extend(headers or [])
    if body:
        out.headers.append(("content-type", content_type or "application/sdp"))
    out.body = body
    return out


def _mark_source(via: str, source: tuple[str, int]) -> str:
    """Add ``received`` when the sent-by host is not the source, fill an empty ``rport``."""
    parts = via.split(";")
    sent_by = parts[0].split()[-1] if parts[0].split() else ""
    host = sent_by.rsplit(":", 1)[0] if not sent_by.endswith("]") else sent_by
    host = host.strip("[]")
    out = [parts[0]]
    for part in parts[1:]:
        if part.strip().lower() == "rport":
            part = f"rport={source[1]}"
        out.append(part)
    mark = host != source[0] or any(p.startswith("rport=") for p in out[1:])
    if mark and not any(p.strip().lower().startswith("received=") for p in out[1:]):
        out.append(f"received={source[0]}")
    return ";".join(out)
