"""Calls we place (the UAC side, RFC 3261 §13.2, §17.1.1): one outgoing INVITE until it is answered.

:func:`parse_target` reads where a call goes: a ``sip:`` URI whose host is an IP address (we look no
name up: the allow-list is of addresses, and nothing is sent anywhere before it is checked) on UDP,
with nothing in it that could end a header or start another. The server (server.py) checks the host
against the same allow-list its peers pass, opens the call's RTP ports and starts a :class:`Dialling`:

- the INVITE carries our SDP offer (sdp.offer: PCMU, PCMA, telephone-event) and is retransmitted
  (timer A: T1, 2*T1, 4*T1, ...) until a response comes; none within 64*T1 (timer B) fails the
  call with 408;
- 100 stops the retransmissions; 180 and 183 make the call ``ringing`` (183's early media is not
  played to anyone: the session starts when the callee answers);
- a 2xx is acknowledged (a new ACK transaction to the callee's Contact, through its Record-Route
  reversed) and becomes a :class:`~.call.SipCall` of the server, confirmed at once: the ``answer``
  callback (the agent) gets its :class:`~.handler.SipCallInfo` and returns its media, or refuses
  (the call is then hung up with a BYE). A 2xx retransmitted by the callee gets the same ACK again;
- a 3xx-6xx is acknowledged (in the INVITE's transaction) and the call ``failed`` with its status;
- :meth:`Dialling.cancel` (the app hung up, or nobody answered within the ring timeout) sends a
  CANCEL once a provisional response came (§9.1: not before), and the callee's 487 ends it as
  ``cancelled`` or ``no_answer``; a 2xx that crossed the CANCEL is acknowledged and hung up.

Each state change is reported to ``on_progress`` (the agent keeps it for the API). The Dialling
belongs to the server's table from the INVITE until 64*T1 after the final response (so that
retransmitted finals are acknowledged again, RFC 6026), and owns the RTP session until a SipCall
takes it; every way out closes what it still owns.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from .call import Signalling, SipCall
from .handler import CallControl, CallMedia, CallRefused, InvalidTarget, SipCallInfo
from .media import RtpSession
from .message import SipMessage, display_name, uri_of
from .sdp import Negotiated, SdpError, negotiate, offer
from .transaction import ALLOW, Retransmitter

log = logging.getLogger(__name__)

DialState = Literal["dialing", "ringing", "answered", "failed", "cancelled", "no_answer"]
FINAL_STATES = frozenset({"answered", "failed", "cancelled", "no_answer"})

# RFC 3261 §25.1 user characters and parameter characters, less ",", ";" and "?" in the user part
# and "?" anywhere: URI headers (``?X=...``) would become headers of the INVITE.
_USER = r"[A-Za-z0-9\-_.!~*'()&=+$%]+"
_PARAM = r";[A-Za-z0-9\-_.!~*'%]+(?:=[A-Za-z0-9\-_.!~*'%]+)?"
_TARGET = re.compile(rf"sip:(?:(?P<user>{_USER})@)?(?P<host>[0-9.]+|\[[0-9A-Fa-f:.]+\])"
                     rf"(?::(?P<port>\d{{1,5}}))?(?P<params>(?:{_PARAM})*)\Z")
MAX_TARGET = 1024


class TargetNotAllowed(InvalidTarget):
    """A well-formed target whose address the allow-list does not let us talk to."""


class DialError(Exception):
    """A call that cannot be placed now (no RTP port left, the server closing)."""


@dataclass(frozen=True)
class Target:
    """Where a call goes: the Request-URI and the address its signalling is sent to."""

    uri: str
    address: tuple[str, int]


def parse_target(uri: str) -> Target:
    """The target of ``uri`` (module doc); raises :class:`InvalidTarget` saying what is wrong."""
    if len(uri) > MAX_TARGET:
        raise InvalidTarget(f"the target URI is longer than {MAX_TARGET} characters")
    match = _TARGET.match(uri)
    if match is None:
        raise InvalidTarget(f"not a sip: URI with an IP address for host (sip:user@192.0.2.1:5060), "
                            f"without spaces, brackets, quotes or URI headers: {uri[:80]!r}")
    host = match.group("host").strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise InvalidTarget(f"the target's host {host!r} is not an IP address") from None
    port = int(match.group("port") or 5060)
    if not 0 < port < 65536:
        raise InvalidTarget(f"the target's port {port} is out of range")
    for item in match.group("params").split(";")[1:]:
        name, _, value = item.partition("=")
        if name.lower() == "transport" and value.lower() != "udp":
            raise InvalidTarget(f"only UDP is supported, not transport={value}")
    return Target(uri, (host, port))


class DialSignalling(Signalling, Protocol):
    """What a Dialling needs from the server beyond a call's needs."""

    def send(self, data: bytes, addr: tuple[str, int]) -> None: ...

    def adopt(self, call: SipCall) -> None: ...

    def untrack(self, dialling: Dialling) -> None: ...


DialledAcceptor = Callable[[SipCallInfo, CallControl], CallMedia]


class Dialling:
    """One INVITE we send and its outcome (module doc). Built and started by ``SipServer.dial``."""

    def __init__(self, sig: DialSignalling, target: Target, media: RtpSession,
                 answer: DialledAcceptor, on_progress: Callable[[Dialling], None],
                 ring_timeout_s: float) -> None:
        self._sig = sig
        self.target = target
        self._media: RtpSession | None = media  # until a SipCall takes it
        self._answer = answer
        self._on_progress = on_progress
        self._ring_timeout_s = ring_timeout_s
        self.call_id = secrets.token_hex(16)
        self.branch = f"z9hG4bK{secrets.token_hex(8)}"
        self.state: DialState = "dialing"
        self.status: int | None = None  # the latest response's status
        self.reason = ""
        self.call: SipCall | None = None  # once answered
        self.log = logging.LoggerAdapter(log, {"session_id": self.call_id})
        self._sdp_session = random.getrandbits(31)
        self._invite = self._build_invite()
        self._provisional = False  # a 1xx came: a CANCEL may be sent (§9.1)
        self._cancelling: DialState | None = None  # what a cancel ends in: cancelled, no_answer
        self._final: SipMessage | None = None
        self._ack = b""  # our ACK of the final response, sent again for its retransmissions
        self._retransmit: Retransmitter | None = None
        self._timers: list[asyncio.TimerHandle] = []

    @property
    def done(self) -> bool:
        return self.state in FINAL_STATES

    def _build_invite(self) -> SipMessage:
        sig = self._sig
        assert self._media is not None
        body = offer(sig.advertise, self._media.port, self._sdp_session, 1).encode()
        invite = SipMessage(method="INVITE", uri=self.target.uri, body=body)
        invite.headers = [
            ("via", f"SIP/2.0/UDP {sig.contact_host};rport;branch={self.branch}"),
            ("max-forwards", "70"),
            ("from", f"<sip:duplex@{sig.contact_host}>;tag={secrets.token_hex(6)}"),
            ("to", f"<{self.target.uri}>"),
            ("call-id", self.call_id),
            ("cseq", f"{random.randint(1, 10000)} INVITE"),
            ("contact", sig.contact),
            ("allow", ALLOW),
            ("content-type", "application/sdp"),
        ]
        return invite

    def start(self) -> None:
        """Send the INVITE (retransmitted until a response) and start the ring timeout."""
        data = self._invite.serialise()
        self.log.info("calling %s", self.target.uri)
        self._retransmit = Retransmitter(lambda: self._sig.send(data, self.target.address),
                                         self._sig.timers, on_timeout=self._no_response,
                                         capped=False)
        loop = asyncio.get_running_loop()
        self._timers.append(loop.call_later(self._ring_timeout_s, self.cancel, "no_answer"))

    # Responses ----------------------------------------------------------------------------

    def on_response(self, msg: SipMessage) -> None:
        """A response to our INVITE (the server routes them here by Via branch)."""
        if self._retransmit is not None:  # any response ends timer A, and timer B (§17.1.1.2)
            self._retransmit.stop()
            self._retransmit = None
        if msg.status < 200:
            self._on_provisional(msg)
        elif self._final is not None:
            self._again(msg)
        elif msg.status < 300:
            self._on_ok(msg)
        else:
            self._on_refused(msg)

    def _on_provisional(self, msg: SipMessage) -> None:
        if self.done:
            return
        first = not self._provisional
        self._provisional = True
        if self._cancelling is not None and first:
            self._send_cancel()  # asked for before anything came back (§9.1)
        if msg.status > 100 and self.state == "dialing" and self._cancelling is None:
            self._report("ringing", msg.status, msg.reason)

    def _again(self, msg: SipMessage) -> None:
        """A final response after the first: a retransmission gets our ACK again."""
        assert self._final is not None
        if msg.status == self._final.status and msg.to_tag == self._final.to_tag:
            self._sig.send(self._ack, self.target.address)
        else:  # another fork's answer: we keep the first (RFC 3261 §13.2.2.4 would BYE a 2xx)
            self.log.info("ignoring a second final response %d from another branch", msg.status)

    def _on_ok(self, ok: SipMessage) -> None:
        self._final = ok
        try:
            neg, unusable = negotiate(ok.body.decode("utf-8", "replace")), None
        except SdpError as exc:
            # The dialog exists all the same and must be ended with a BYE; its media never runs,
            # so our own offer stands in for the answer.
            neg, unusable = negotiate(self._invite.body.decode()), exc
        call = self._confirm(ok, neg)
        if self.done or self._cancelling is not None:  # (done: given up without a final answer)
            self.log.info("answered as the call was given up: hanging up")
            call.end("hangup")
            if not self.done:
                self._finish(self._cancelling or "cancelled", ok.status, ok.reason)
            return
        if unusable is not None:
            self.log.warning("the callee's answer is unusable (%s): hanging up", unusable)
            call.end("bad-sdp")
            return self._finish("failed", 488, f"unusable SDP answer: {unusable}")
        info = SipCallInfo(
            call_id=self.call_id, peer=self.target.address,
            from_uri=uri_of(self._invite.get("from") or ""), to_uri=self.target.uri,
            codec=neg.codec, dtmf=neg.dtmf_payload_type is not None,
            local_rtp=(self._sig.advertise, call.media.port if call.media else 0),
            remote_rtp=neg.remote,
            headers=tuple((display_name(name), value) for name, value in ok.headers),
            outbound=True)
        try:
            handler = self._answer(info, call)
        except CallRefused as refused:
            self.log.info("the answered call is refused here: %s", refused)
            call.end("hangup")
            return self._finish("failed", refused.status, refused.reason)
        except Exception:
            self.log.exception("the call acceptor failed")
            call.end("hangup")
            return self._finish("failed", 500, "Server Internal Error")
        self.log.info("answered by %s with %s", self.target.uri, neg.codec)
        self._finish("answered", ok.status, ok.reason)
        call.begin(handler)

    def _confirm(self, ok: SipMessage, neg: Negotiated) -> SipCall:
        """ACK the 2xx (a transaction of its own, §13.2.2.4) and make the call of the dialog."""
        media, self._media = self._media, None  # None: given up already, and released
        call = SipCall.dialled(self._sig, self._invite, ok, self.target.address,
                               neg, media, self._sdp_session)
        ack = SipMessage(method="ACK", uri=uri_of(ok.get("contact") or self.target.uri))
        ack.headers = [
            ("via", f"SIP/2.0/UDP {self._sig.contact_host};rport;branch=z9hG4bK{secrets.token_hex(8)}"),
            ("max-forwards", "70"),
            *[("route", route) for route in reversed(ok.get_all("record-route"))],
            ("from", self._invite.get("from") or ""),
            ("to", ok.get("to") or ""),
            ("call-id", self.call_id),
            ("cseq", f"{self._invite.cseq[0]} ACK"),
        ]
        self._ack = ack.serialise()
        self._sig.send(self._ack, self.target.address)
        self._sig.adopt(call)
        self.call = call
        return call

    def _on_refused(self, msg: SipMessage) -> None:
        """3xx-6xx: ACK it in the INVITE's transaction (§17.1.1.3); the call did not happen."""
        self._final = msg
        ack = SipMessage(method="ACK", uri=self._invite.uri)
        ack.headers = [
            ("via", self._invite.get("via") or ""),
            ("max-forwards", "70"),
            ("from", self._invite.get("from") or ""),
            ("to", msg.get("to") or ""),
            ("call-id", self.call_id),
            ("cseq", f"{self._invite.cseq[0]} ACK"),
        ]
        self._ack = ack.serialise()
        self._sig.send(self._ack, self.target.address)
        if self.done:  # given up already (timer B): acknowledged, nothing more
            return
        cancelled = self._cancelling is not None and msg.status == 487
        self.log.info("the callee answered %d %s", msg.status, msg.reason)
        self._finish(self._cancelling if cancelled and self._cancelling else "failed",
                     msg.status, msg.reason)

    # Giving up ----------------------------------------------------------------------------

    def cancel(self, outcome: DialState = "cancelled") -> None:
        """Give the call up before it is answered: ``cancelled`` (the app hung up) or
        ``no_answer`` (the ring timeout). Nothing once it was answered or failed."""
        if self.done or self._cancelling is not None:
            return
        self._cancelling = outcome
        self.log.info("giving the call up (%s)", outcome)
        if self._provisional:
            self._send_cancel()
        # Else the CANCEL goes when the first provisional response comes (§9.1), or timer B
        # ends the INVITE unanswered.

    def _send_cancel(self) -> None:
        invite = self._invite
        cancel = SipMessage(method="CANCEL", uri=invite.uri)
        cancel.headers = [
            ("via", invite.get("via") or ""),
            ("max-forwards", "70"),
            ("from", invite.get("from") or ""),
            ("to", invite.get("to") or ""),
            ("call-id", self.call_id),
            ("cseq", f"{invite.cseq[0]} CANCEL"),
        ]
        self._sig.send_request(cancel, self.target.address)
        # No final answer to the INVITE within 64*T1 of the CANCEL: it is over all the same.
        self._timers.append(asyncio.get_running_loop().call_later(
            self._sig.timers.timeout, self._no_response))

    def _no_response(self) -> None:
        """Timer B (nothing at all came back), or no final answer after our CANCEL."""
        if self.done:
            return
        self.log.info("no final answer to the INVITE")
        self._finish(self._cancelling or "failed", 408, "Request Timeout")

    def close(self) -> None:
        """The server closes: give up at once (a CANCEL where one may be sent), release all."""
        if not self.done:
            if self._provisional and self._cancelling is None:
                self._send_cancel()
            self._finish("cancelled", 503, "Server Closing")
        self._release()

    # Ending -------------------------------------------------------------------------------

    def _finish(self, state: DialState, status: int, reason: str) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers = []
        if self._retransmit is not None:
            self._retransmit.stop()
            self._retransmit = None
        if self._media is not None:
            self._media.close()
            self._media = None
        self._report(state, status, reason)
        # Kept to acknowledge retransmitted final responses (timer D / RFC 6026 Accepted).
        self._timers.append(asyncio.get_running_loop().call_later(
            self._sig.timers.timeout, self._release))

    def _release(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers = []
        self._sig.untrack(self)

    def _report(self, state: DialState, status: int, reason: str) -> None:
        self.state, self.status, self.reason = state, status, reason
        try:
            self._on_progress(self)
        except Exception:  # the call's signalling must not fail on a listener
            self.log.exception("dialling progress listener failed")

