"""The SIP user agent server on UDP: one socket, the transaction table, calls by dialog.

:class:`SipServer` receives every datagram on its port. It drops what does not parse, answers
what parses but is wrong with the 4xx RFC 3261 names, refuses peers outside the allow-list with
403, absorbs request retransmissions by resending the last response (the server transaction
table, kept 64*T1 after the final response), and routes INVITE / ACK / BYE / CANCEL / NOTIFY to
the call of their dialog (Call-ID + the caller's tag; our tag checked on in-dialog requests), and
the responses to our own requests (BYE, REFER) to whoever sent them, by Via branch.

``dial`` places a call (dial.py): the target is checked against the same allow-list, and the
INVITE's responses are routed to its :class:`~.dial.Dialling` by branch until it is answered (the
call then joins the others) or has failed.

The server owns the socket, the RTP port pool, the transaction table, the calls and the calls
being placed; ``close`` gives up the calls being placed (CANCEL), ends every call with a BYE,
waits briefly for the BYEs to be answered and releases all of it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .call import SipCall
from .dial import DialError, DialledAcceptor, Dialling, TargetNotAllowed, parse_target
from .handler import CallAcceptor
from .media import PortPool, RtpSession
from .message import SipMessage, SipParseError, parse
from .sdp import SdpError, negotiate
from .transaction import ALLOW, Retransmitter, SipTimers, response

log = logging.getLogger(__name__)
_LOOPBACK = ("127.0.0.0/8", "::1/128")
_BYE_GRACE_SECONDS = 2.0  # how long close() waits for the BYEs it sent to be answered


@dataclass(frozen=True)
class SipConfig:
    host: str = "127.0.0.1"  # the address the SIP and RTP sockets bind
    port: int = 5060  # 0: any free port (see SipServer.port)
    allow: Sequence[str] = ()  # CIDRs of peers we talk to; empty: loopback only
    rtp_ports: tuple[int, int] = (40000, 40999)
    advertise: str | None = None  # the address in Contact and SDP; default: host (not 0.0.0.0)
    media_timeout: float = 10.0  # seconds without inbound RTP that end a call
    timers: SipTimers = field(default_factory=SipTimers)


@dataclass
class _ServerTransaction:
    """A request being or having been answered, so its retransmissions get the same answer."""

    addr: tuple[str, int]
    status: int = 0
    data: bytes = b""
    retransmit: Retransmitter | None = None
    expiry: asyncio.TimerHandle | None = None


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, server: SipServer) -> None:
        self._server = server

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        try:
            self._server._received(data, (addr[0], addr[1]))
        except Exception:  # nothing a peer sends may take the server down
            log.exception("failed on a SIP datagram from %s", addr[0])


class SipServer:
    """See module doc. ``accept`` decides on each call (handler.py)."""

    def __init__(self, accept: CallAcceptor, config: SipConfig | None = None) -> None:
        self.config = config or SipConfig()
        self._accept = accept
        self._networks = [ipaddress.ip_network(c, strict=False)
                          for c in (self.config.allow or _LOOPBACK)]
        self._pool = PortPool(*self.config.rtp_ports)
        self._transport: asyncio.DatagramTransport | None = None
        self.port = self.config.port
        if not self.config.advertise and self.config.host in ("0.0.0.0", "::", ""):
            # 0.0.0.0 in an SDP answer means "hold", and in a Contact nothing reachable.
            raise ValueError("SipConfig.advertise is required when host is a wildcard address")
        self.advertise = self.config.advertise or self.config.host
        self.timers = self.config.timers
        self.calls: dict[tuple[str, str], SipCall] = {}  # (Call-ID, caller's tag) -> call
        self._transactions: dict[tuple, _ServerTransaction] = {}
        self._requests: dict[str, Retransmitter] = {}  # our BYEs and REFERs by Via branch
        self._answers: dict[str, Callable[[SipMessage | None], None]] = {}  # who awaits a response
        self._setups: set[asyncio.Task] = set()
        self.dialling: dict[str, Dialling] = {}  # the INVITEs we sent, by Via branch (dial.py)
        self._closing = False  # close() has begun: new calls get 503

    @property
    def contact_host(self) -> str:
        host = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
        return f"{host}:{self.port}"

    @property
    def contact(self) -> str:
        return f"<sip:{self.contact_host}>"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=(self.config.host, self.config.port))
        self.port = self._transport.get_extra_info("sockname")[1]
        log.info("SIP on udp %s:%d (RTP %d-%d)", self.config.host, self.port,
                 *self.config.rtp_ports)

    async def close(self) -> None:
        self._closing = True
        setups = list(self._setups)
        for task in setups:
            task.cancel()
        await asyncio.gather(*setups, return_exceptions=True)
        for dialling in list(self.dialling.values()):
            dialling.close()
        for call in list(self.calls.values()):
            call.end("server-closed")
        pending = [r.wait() for r in self._requests.values()]
        if pending:
            await asyncio.wait([asyncio.ensure_future(p) for p in pending],
                               timeout=_BYE_GRACE_SECONDS)
        for retransmitter in list(self._requests.values()):
            retransmitter.stop()
        self._answers.clear()
        for tx in self._transactions.values():
            if tx.retransmit is not None:
                tx.retransmit.stop()
            if tx.expiry is not None:
                tx.expiry.cancel()
        self._transactions.clear()
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def allowed(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        return any(address in network for network in self._networks)

    # Signalling interface for calls (call.Signalling) ---------------------------------------

    def respond(self, request: SipMessage, addr: tuple[str, int], status: int, *,
                to_tag: str | None = None, headers: list[tuple[str, str]] | None = None,
                body: bytes = b"", reason: str | None = None,
                on_timeout=None) -> Retransmitter | None:
        """Answer ``request``; a final answer to an INVITE is retransmitted until its ACK."""
        data = response(request, status, addr, to_tag=to_tag, headers=headers, body=body,
                        reason=reason).serialise()
        tx = self._transactions.setdefault(_key(request), _ServerTransaction(addr))
        tx.status, tx.data = status, data
        if status < 200:
            self.send(data, addr)
            return None
        loop = asyncio.get_running_loop()
        if tx.expiry is None:
            tx.expiry = loop.call_later(self.timers.timeout,
                                        self._transactions.pop, _key(request), None)
        if request.method != "INVITE":
            self.send(data, addr)
            return None
        if tx.retransmit is not None:
            tx.retransmit.stop()
        tx.retransmit = Retransmitter(lambda: self.send(data, addr), self.timers,
                                      on_timeout)
        return tx.retransmit

    def send_request(self, request: SipMessage, addr: tuple[str, int],
                     on_response: Callable[[SipMessage | None], None] | None = None) -> None:
        """Send a request of a call (BYE, REFER), retransmitted until its final response, which
        ``on_response`` gets (None: none came within 64*T1)."""
        data = request.serialise()
        branch = request.branch

        def timed_out() -> None:
            self._requests.pop(branch, None)
            if self._answers.pop(branch, None) is not None and on_response is not None:
                on_response(None)

        self._requests[branch] = Retransmitter(lambda: self.send(data, addr), self.timers,
                                               on_timeout=timed_out)
        if on_response is not None:
            self._answers[branch] = on_response

    async def dial(self, target_uri: str, answer: DialledAcceptor,
                   on_progress: Callable[[Dialling], None], ring_timeout_s: float) -> Dialling:
        """Place a call to ``target_uri`` (dial.py); returns once the INVITE is sent. Raises
        InvalidTarget (TargetNotAllowed: outside the allow-list) before anything is sent, or
        DialError when no call can be placed now."""
        target = parse_target(target_uri)
        if not self.allowed(target.address[0]):
            raise TargetNotAllowed(f"the target's address {target.address[0]} is not in the "
                                   "SIP allow-list (--sip-allow)")
        if self._closing or self._transport is None:
            raise DialError("the SIP server is not running")
        try:
            media = await self.open_media(logging.LoggerAdapter(log, {"session_id": "dial"}))
        except OSError:
            raise DialError("no RTP port left") from None
        if self._closing:
            media.close()
            raise DialError("the SIP server is closing")
        dialling = Dialling(self, target, media, answer, on_progress, ring_timeout_s)
        media.log = dialling.log
        self.dialling[dialling.branch] = dialling
        dialling.start()
        return dialling

    def adopt(self, call: SipCall) -> None:
        """A call we placed was answered: its dialog's requests come to it from now on."""
        self.calls[(call.call_id, call.remote_tag)] = call

    def untrack(self, dialling: Dialling) -> None:
        if self.dialling.get(dialling.branch) is dialling:
            del self.dialling[dialling.branch]

    def open_media(self, log: logging.LoggerAdapter):
        return RtpSession.open(self.config.host, self._pool, self.allowed,
                               self.config.media_timeout, log)

    def forget(self, call: SipCall) -> None:
        if self.calls.get((call.call_id, call.remote_tag)) is call:
            del self.calls[(call.call_id, call.remote_tag)]

    # Receiving ------------------------------------------------------------------------------

    def send(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._transport is not None:
            self._transport.sendto(data, addr)

    def _received(self, data: bytes, addr: tuple[str, int]) -> None:
        if not data.strip(b"\r\n"):
            return  # a keep-alive (RFC 5626 §3.5.1)
        try:
            msg = parse(data)
        except SipParseError as exc:
            bad = exc.message
            log.info("unacceptable SIP message from %s: %s", addr[0], exc.reason)
            if (exc.status and bad is not None and bad.method not in ("", "ACK")
                    and bad.get("via") and self.allowed(addr[0])):
                self.send(response(bad, exc.status, addr, to_tag=_tag()).serialise(), addr)
            return
        if not msg.is_request:
            self._on_response(msg)
            return
        if not self.allowed(addr[0]):
            log.warning("SIP %s from %s refused: not in the allow-list", msg.method, addr[0],
                        extra={"session_id": msg.call_id})
            if msg.method != "ACK":
                self.send(response(msg, 403, addr, to_tag=_tag()).serialise(), addr)
            return
        if msg.method == "ACK":
            self._on_ack(msg)
            return
        tx = self._transactions.get(_key(msg))
        if tx is not None:  # a retransmission: the same answer again, if there is one yet
            if tx.data:
                self.send(tx.data, addr)
            return
        self._transactions[_key(msg)] = _ServerTransaction(addr)
        self._dispatch(msg, addr)

    def _dispatch(self, msg: SipMessage, addr: tuple[str, int]) -> None:
        method = msg.method
        if method not in ("INVITE", "BYE", "CANCEL", "OPTIONS", "NOTIFY"):
            self.respond(msg, addr, 405, to_tag=_tag(), headers=[("allow", ALLOW)])
            return
        required = msg.get_all("require")
        if required and method != "CANCEL":
            # We implement no SIP extension (RFC 3261 §8.2.2.3).
            self.respond(msg, addr, 420, to_tag=_tag(),
                         headers=[("unsupported", ", ".join(required))])
            return
        call = self.calls.get((msg.call_id, msg.from_tag or ""))
        if method == "OPTIONS":
            self.respond(msg, addr, 200, to_tag=_tag(), headers=[
                ("allow", ALLOW), ("accept", "application/sdp"), ("accept-encoding", "identity"),
                ("contact", self.contact)])
        elif method == "CANCEL":
            self._on_cancel(msg, addr, call)
        elif msg.to_tag:  # BYE, NOTIFY or re-INVITE: inside a dialog, which must be ours
            if call is None or call.local_tag != msg.to_tag:
                self.respond(msg, addr, 481)
            elif method == "BYE":
                call.on_bye(msg, addr)
            elif method == "NOTIFY":
                call.on_notify(msg, addr)
            else:
                call.on_reinvite(msg, addr)
        elif method in ("BYE", "NOTIFY"):
            self.respond(msg, addr, 481, to_tag=_tag())
        elif call is not None:
            # The same dialog-creating INVITE on another branch: a merged request (§8.2.2.2).
            self.respond(msg, addr, 482, to_tag=_tag())
        elif self._closing:
            self.respond(msg, addr, 503, to_tag=_tag(), headers=[("retry-after", "5")])
        else:
            self._on_invite(msg, addr)

    def _on_invite(self, msg: SipMessage, addr: tuple[str, int]) -> None:
        content_type = (msg.get("content-type") or "").split(";")[0].strip().lower()
        encoding = (msg.get("content-encoding") or "identity").lower()
        if msg.body and encoding != "identity":
            self.respond(msg, addr, 415, to_tag=_tag(),
                         headers=[("accept-encoding", "identity")])
            return
        if msg.body and content_type != "application/sdp":
            self.respond(msg, addr, 415, to_tag=_tag(), headers=[("accept", "application/sdp")])
            return
        if not msg.body:
            # An offer in the ACK (RFC 3264 delayed offer) is not supported: 488 tells why.
            self.respond(msg, addr, 488, to_tag=_tag(), headers=[
                ("warning", '399 - "an SDP offer is required"')])
            return
        try:
            neg = negotiate(msg.body.decode("utf-8", "replace"))
        except SdpError as exc:
            log.info("INVITE from %s refused: %s", addr[0], exc, extra={"session_id": msg.call_id})
            self.respond(msg, addr, 488, to_tag=_tag(), headers=[
                ("warning", f'304 - "{exc}"')])
            return
        self.respond(msg, addr, 100)
        call = SipCall.offered(self, msg, addr, neg)
        self.calls[(call.call_id, call.remote_tag)] = call
        task = asyncio.get_running_loop().create_task(call.setup(self._accept))
        self._setups.add(task)
        task.add_done_callback(self._setups.discard)

    def _on_ack(self, ack: SipMessage) -> None:
        tx = self._transactions.get(_key(ack, "INVITE"))
        if tx is not None and tx.status >= 300 and tx.retransmit is not None:
            tx.retransmit.stop()  # the ACK of a refusal: same transaction (§17.2.1)
            return
        call = self.calls.get((ack.call_id, ack.from_tag or ""))
        if call is not None and call.local_tag == ack.to_tag:
            call.on_ack(ack)

    def _on_cancel(self, cancel: SipMessage, addr: tuple[str, int],
                   call: SipCall | None) -> None:
        invite = self._transactions.get(_key(cancel, "INVITE"))
        if invite is None:
            self.respond(cancel, addr, 481, to_tag=_tag())
            return
        self.respond(cancel, addr, 200, to_tag=call.local_tag if call else _tag())
        if call is not None and invite.status < 200:
            call.cancel()

    def _on_response(self, msg: SipMessage) -> None:
        dialling = self.dialling.get(msg.branch)
        if dialling is not None and msg.cseq[1] == "INVITE":  # a CANCEL shares the branch
            dialling.on_response(msg)
            return
        if msg.status < 200:
            return
        retransmitter = self._requests.pop(msg.branch, None)
        if retransmitter is not None:
            retransmitter.stop()
        on_response = self._answers.pop(msg.branch, None)
        if on_response is not None:
            on_response(msg)


def _key(msg: SipMessage, method: str | None = None) -> tuple:
    """A server transaction's identity (RFC 3261 §17.2.3; without a branch, RFC 2543 style)."""
    branch = msg.branch if msg.branch.startswith("z9hG4bK") else f"2543:{msg.from_tag}"
    return (msg.call_id, branch, msg.cseq[0], method or msg.method)


def _tag() -> str:
    return secrets.token_hex(6)
