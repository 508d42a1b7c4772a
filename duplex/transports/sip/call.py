"""One SIP call: its dialog (RFC 3261 §12), its INVITE answers and its media.

States: ``offered`` (INVITE received, the acceptor deciding) → ``answered`` (200 OK sent and
retransmitted, waiting for the ACK) → ``confirmed`` (ACK received) → ``ended``. A confirmed call
may be transferred (REFER, refer.py); a transfer that succeeds ends it. Every way out
goes through :meth:`SipCall.end`, which runs once: it sends the BYE when the call was answered and
we are the ones ending it, closes the RTP session and calls the media object's ``on_ended``.

A call we placed (dial.py) is made when the callee's 2xx is acknowledged, confirmed from the
start (:meth:`SipCall.dialled`); from then on it is like any other.

The server (server.py) creates a call per new INVITE (or adopts the one dial.py made), routes the
dialog's requests to it and forgets it when it ends; the call owns its RTP session, its media
object and its 2xx retransmitter, and releases all three in ``end``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from .handler import (
    CallAcceptor,
    CallMedia,
    CallRefused,
    EndReason,
    InvalidTarget,
    ReferError,
    SipCallInfo,
)
from .media import RtpSession
from .message import SipMessage, display_name, uri_of
from .refer import Transfer, valid_target
from .sdp import Negotiated, SdpError, answer, negotiate
from .transaction import ALLOW, Retransmitter, SipTimers

log = logging.getLogger(__name__)


class Signalling(Protocol):
    """What a call needs from the server: sending, media ports, and being forgotten."""

    advertise: str  # our address in SDP
    contact: str  # our Contact header value
    contact_host: str  # host:port for our Via
    timers: SipTimers

    def respond(self, request: SipMessage, addr: tuple[str, int], status: int, *,
                to_tag: str | None = None, headers: list[tuple[str, str]] | None = None,
                body: bytes = b"", reason: str | None = None,
                on_timeout=None) -> Retransmitter | None: ...

    def send_request(self, request: SipMessage, addr: tuple[str, int],
                     on_response: Callable[[SipMessage | None], None] | None = None) -> None: ...

    def open_media(self, log: logging.LoggerAdapter) -> Awaitable[RtpSession]: ...

    def forget(self, call: SipCall) -> None: ...


@dataclass(frozen=True)
class Dialog:
    """What identifies a dialog and what our requests in it carry (RFC 3261 §12)."""

    call_id: str
    local_tag: str
    remote_tag: str
    local: str  # our From in requests (name-addr with our tag)
    remote: str  # their To in requests (with their tag)
    target: str  # the remote target: where our requests' Request-URI points (their Contact)
    routes: list[str]  # the route set, in the order our requests carry it
    remote_cseq: int  # the last CSeq number of their requests
    local_cseq: int  # the last CSeq number of ours


class SipCall:
    """See module doc. Implements :class:`~.handler.CallControl` for the media object."""

    def __init__(self, sig: Signalling, invite: SipMessage, peer: tuple[str, int],
                 neg: Negotiated, dialog: Dialog) -> None:
        """Use :meth:`offered` (we answer ``invite``) or :meth:`dialled` (we sent it)."""
        self._sig = sig
        self._invite = invite  # the dialog's INVITE: answered from it while "offered"
        self.peer = peer
        self._call_id = dialog.call_id
        self.remote_tag = dialog.remote_tag
        self.local_tag = dialog.local_tag
        self.state = "offered"
        self.end_reason: EndReason | None = None
        self.ended = asyncio.Event()
        self.log = logging.LoggerAdapter(log, {"session_id": self._call_id})
        self._local = dialog.local
        self._remote = dialog.remote
        self._target = dialog.target
        self._routes = dialog.routes
        self._remote_cseq = dialog.remote_cseq
        self._local_cseq = dialog.local_cseq
        # Offer/answer state.
        self.negotiated = neg
        self._sdp_session = random.getrandbits(31)
        self._sdp_version = 0
        self._ack_cseq = invite.cseq[0]  # the INVITE whose 2xx awaits its ACK
        self._offer_in_ack = False  # our 200 carried an offer (the re-INVITE had none)
        self._retransmit: Retransmitter | None = None
        self.media: RtpSession | None = None
        self._handler: CallMedia | None = None
        # The acceptor deciding on the call (when it answers awaitably): cancelled by end().
        self._deciding: asyncio.Future[CallMedia] | None = None
        self._transfer: Transfer | None = None  # the latest REFER we sent (refer.py)

    @classmethod
    def offered(cls, sig: Signalling, invite: SipMessage, peer: tuple[str, int],
                neg: Negotiated) -> SipCall:
        """The call of an INVITE we received (we are its UAS): RFC 3261 §12.1.1, our From in
        requests is the INVITE's To plus our tag."""
        local_tag = secrets.token_hex(6)
        remote = invite.get("from") or ""
        return cls(sig, invite, peer, neg, Dialog(
            call_id=invite.call_id, local_tag=local_tag, remote_tag=invite.from_tag or "",
            local=f"{invite.get('to')};tag={local_tag}", remote=remote,
            target=uri_of(invite.get("contact") or remote), routes=invite.get_all("record-route"),
            remote_cseq=invite.cseq[0], local_cseq=random.randint(1, 10000)))

    @classmethod
    def dialled(cls, sig: Signalling, invite: SipMessage, ok: SipMessage, peer: tuple[str, int],
                neg: Negotiated, media: RtpSession | None, sdp_session: int) -> SipCall:
        """The call of an INVITE we sent (dial.py), answered by ``ok`` and acknowledged:
        RFC 3261 §12.1.2, the callee's tag and Contact from the 2xx, its Record-Route reversed.
        Confirmed from the start; :meth:`begin` runs its media (``media`` None: a call answered
        after we gave it up, which is only hung up)."""
        remote = ok.get("to") or ""
        call = cls(sig, invite, peer, neg, Dialog(
            call_id=invite.call_id, local_tag=invite.from_tag or "", remote_tag=ok.to_tag or "",
            local=invite.get("from") or "", remote=remote,
            target=uri_of(ok.get("contact") or invite.uri),
            routes=list(reversed(ok.get_all("record-route"))),
            remote_cseq=-1, local_cseq=invite.cseq[0]))  # -1: the callee's first CSeq is any
        call.state = "confirmed"
        call.media = media
        call._sdp_session, call._sdp_version = sdp_session, 1  # our offer's o= line
        return call

    @property
    def call_id(self) -> str:
        return self._call_id

    # Setting the call up ------------------------------------------------------------------

    async def setup(self, accept: CallAcceptor) -> None:
        """Bind RTP, ask the acceptor, answer the INVITE (200 with SDP, or its refusal)."""
        try:
            self.media = await self._sig.open_media(self.log)
        except OSError:
            self.log.warning("no RTP port left: refusing the call")
            return self._refuse(503, [("retry-after", "5")])
        if self.state == "ended":  # cancelled meanwhile
            return self.media.close()
        neg = self.negotiated
        info = SipCallInfo(
            call_id=self._call_id, peer=self.peer, from_uri=uri_of(self._remote),
            to_uri=uri_of(self._invite.get("to") or ""), codec=neg.codec,
            dtmf=neg.dtmf_payload_type is not None,
            local_rtp=(self._sig.advertise, self.media.port), remote_rtp=neg.remote,
            headers=tuple((display_name(name), value) for name, value in self._invite.headers),
        )
        try:
            handler = accept(info, self)
            if inspect.isawaitable(handler):
                self._deciding = asyncio.ensure_future(handler)
                # Past 64*T1 the caller's INVITE transaction has given up (timer B): no answer
                # could reach it any more.
                handler = await asyncio.wait_for(self._deciding, self._sig.timers.timeout)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the server closes: setup itself is cancelled
            return  # the call ended while the acceptor decided (end() cancelled it)
        except CallRefused as refused:
            self.log.info("call refused: %d %s", refused.status, refused.reason)
            extra = []
            if refused.status == 503:
                extra.append(("retry-after", str(refused.retry_after or 5)))
            return self._refuse(refused.status, extra, refused.reason)
        except TimeoutError:
            self.log.warning("the call acceptor did not decide in time")
            return self._refuse(500, [])
        except Exception:
            self.log.exception("the call acceptor failed")
            return self._refuse(500, [])
        if self.state == "ended":  # cancelled (or hung up) while the acceptor decided
            self._safe(handler.on_ended, self.end_reason or "cancelled")
            return
        self.state = "answered"
        self.log.info("answering %s with %s from %s", info.from_uri, neg.codec, self.peer[0])
        self._answer(self._invite, neg)
        self.begin(handler)

    def begin(self, handler: CallMedia) -> None:
        """Run the call's media for ``handler`` (answered, or a dialled call confirmed)."""
        assert self.media is not None
        self._handler = handler
        self.media.start(handler, self.negotiated, on_timeout=lambda: self.end("media-timeout"))
        if self.negotiated.held:
            self._safe(handler.on_hold, True)

    def _refuse(self, status: int, headers: list[tuple[str, str]],
                reason: str | None = None) -> None:
        if self.state == "ended":  # already answered by a CANCEL or close()
            return
        self._sig.respond(self._invite, self.peer, status, to_tag=self.local_tag,
                          headers=headers, reason=reason)
        self.state = "ended"
        self._release()

    def _answer(self, invite: SipMessage, neg: Negotiated) -> None:
        assert self.media is not None
        self._sdp_version += 1
        sdp = answer(neg, self._sig.advertise, self.media.port, self._sdp_session,
                     self._sdp_version)
        if self._retransmit is not None:
            self._retransmit.stop()
        self._ack_cseq = invite.cseq[0]
        self._retransmit = self._sig.respond(
            invite, self.peer, 200, to_tag=self.local_tag, body=sdp.encode(),
            headers=[("contact", self._sig.contact), ("allow", ALLOW)],
            on_timeout=lambda: self.end("no-ack"),
        )

    # Requests inside the dialog -----------------------------------------------------------

    def cancel(self) -> None:
        """CANCEL before our final answer: 487 for the INVITE, and the call is over."""
        if self.state != "offered":
            return
        self._sig.respond(self._invite, self.peer, 487, to_tag=self.local_tag)
        self.end("cancelled")

    def on_ack(self, ack: SipMessage) -> None:
        if ack.cseq[0] != self._ack_cseq or self._retransmit is None:
            return
        self._retransmit.stop()
        self._retransmit = None
        if self.state == "answered":
            self.state = "confirmed"
            self.log.info("call confirmed")
        if self._offer_in_ack and ack.body:
            self._offer_in_ack = False
            try:
                self._apply(negotiate(ack.body.decode("utf-8", "replace")))
            except SdpError as exc:
                self.log.warning("unusable SDP in ACK (%s): hanging up", exc)
                self.end("bad-sdp")

    def on_bye(self, bye: SipMessage, addr: tuple[str, int]) -> None:
        self._sig.respond(bye, addr, 200)
        self.end("bye")

    def on_reinvite(self, invite: SipMessage, addr: tuple[str, int]) -> None:
        """A re-INVITE: answer its offer (hold / resume / new address), or offer in the 200."""
        if self.state in ("offered", "ended"):
            self._sig.respond(invite, addr, 500, headers=[("retry-after", "1")])
            return
        number = invite.cseq[0]
        if number <= self._remote_cseq:  # RFC 3261 §12.2.2: out of order
            self._sig.respond(invite, addr, 500)
            return
        self._remote_cseq = number
        if invite.get("contact"):
            self._target = uri_of(invite.get("contact") or "")
        if not invite.body:
            # No offer: ours goes in the 200 (the current one again) and the answer in the ACK.
            self._offer_in_ack = True
            self._answer(invite, self.negotiated)
            return
        try:
            neg = negotiate(invite.body.decode("utf-8", "replace"))
        except SdpError as exc:
            # RFC 3264 §8: a rejected re-offer leaves the session as it was.
            self.log.info("re-INVITE offer rejected: %s", exc)
            self._sig.respond(invite, addr, 488)
            return
        self._apply(neg)
        self._answer(invite, neg)

    def _apply(self, neg: Negotiated) -> None:
        was_held = self.negotiated.held
        self.negotiated = neg
        if self.media is not None:
            self.media.update(neg)
        if neg.held != was_held:
            self.log.info("call %s", "held" if neg.held else "resumed")
            if self._handler is not None:
                self._safe(self._handler.on_hold, neg.held)

    # Ending -------------------------------------------------------------------------------

    def hangup(self) -> None:
        """CallControl: end the call with a BYE."""
        self.end("hangup")

    def ring(self) -> None:
        """CallControl: 180 Ringing while the acceptor decides (resent with the INVITE's
        retransmissions by the server's transaction table)."""
        if self.state == "offered":
            self._sig.respond(self._invite, self.peer, 180, to_tag=self.local_tag,
                              headers=[("contact", self._sig.contact)])

    def end(self, reason: EndReason) -> None:
        """End the call once (see module doc)."""
        if self.state == "ended":
            return
        answered = self.state in ("answered", "confirmed")
        if self.state == "offered" and reason != "cancelled":  # (a CANCEL sent its 487)
            closing = reason == "server-closed"
            self._sig.respond(self._invite, self.peer, 503 if closing else 603,
                              to_tag=self.local_tag,
                              headers=[("retry-after", "5")] if closing else [])
        self.state = "ended"
        self.end_reason = reason
        self.log.info("call ended: %s", reason)
        if answered and reason != "bye":
            self._send_bye()
        handler = self._handler
        self._release()
        if self._deciding is not None and not self._deciding.done():
            self._deciding.cancel()  # the acceptor lets go of the undecided call (handler.py)
        if handler is not None:
            self._safe(handler.on_ended, reason)

    def _release(self) -> None:
        if self._retransmit is not None:
            self._retransmit.stop()
            self._retransmit = None
        if self.media is not None:
            self.media.close()
        self._handler = None
        self._sig.forget(self)
        self.ended.set()

    def _send_bye(self) -> None:
        self._send("BYE")

    def _send(self, method: str, headers: list[tuple[str, str]] | None = None,
              on_response: Callable[[SipMessage | None], None] | None = None) -> None:
        """A new request of ours inside the dialog (RFC 3261 §12.2.1.1)."""
        self._local_cseq += 1
        request = SipMessage(method=method, uri=self._target)
        request.headers = [
            ("via", f"SIP/2.0/UDP {self._sig.contact_host};rport;branch={_branch()}"),
            ("max-forwards", "70"),
            *[("route", route) for route in self._routes],
            ("from", self._local),
            ("to", self._remote),
            ("call-id", self._call_id),
            ("cseq", f"{self._local_cseq} {method}"),
            *(headers or []),
        ]
        # To where the INVITE came from, not to a resolved Contact: symmetric signalling works
        # through NAT, and we never send to an address the allow-list did not let in.
        self._sig.send_request(request, self.peer, on_response)

    # Transfer (refer.py) ------------------------------------------------------------------

    def refer(self, target_uri: str, on_progress: Callable[[int, str, str], None]) -> None:
        """CallControl: a REFER to the caller naming ``target_uri`` (handler.py)."""
        if not valid_target(target_uri):
            raise InvalidTarget(f"not a sip:, sips: or tel: URI: {target_uri!r}")
        if self.state not in ("answered", "confirmed"):  # the dialog exists once our 200 went
            raise ReferError("the call is not answered")
        if self._transfer is not None and not self._transfer.done:
            raise ReferError(f"a transfer to {self._transfer.target_uri} is under way")
        self._transfer = transfer = Transfer(target_uri, on_progress, self.log)
        self.log.info("transferring the call to %s", target_uri)
        self._send("REFER", [("refer-to", f"<{target_uri}>"),
                             ("referred-by", f"<{uri_of(self._local)}>"),
                             ("contact", self._sig.contact)], transfer.on_response)

    def on_notify(self, notify: SipMessage, addr: tuple[str, int]) -> None:
        """A NOTIFY of our REFER's subscription; a 2xx status in it ends the call."""
        transfer = self._transfer
        if transfer is None or self.state == "ended":
            self._sig.respond(notify, addr, 481)
            return
        self._sig.respond(notify, addr, transfer.on_notify(notify))
        if transfer.succeeded:
            self.end("transferred")

    def _safe(self, callback, *args) -> None:
        try:
            callback(*args)
        except Exception:
            self.log.exception("call media callback failed")


def _branch() -> str:
    """A new client transaction's branch, with RFC 3261's magic cookie."""
    return f"z9hG4bK{secrets.token_hex(8)}"
