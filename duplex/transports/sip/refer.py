"""Transferring an answered call: REFER (RFC 3515) and the NOTIFYs of its implicit subscription.

The server asks the caller's side to call ``target_uri`` itself (a blind transfer): a REFER in the
call's dialog with ``Refer-To: <target_uri>``. The caller's side answers the REFER (202 Accepted,
or a refusal), then reports how its call to the target goes in NOTIFYs (``Event: refer``) whose
``message/sipfrag`` body is that call's status line (``SIP/2.0 100 Trying``, ``SIP/2.0 180
Ringing``, ``SIP/2.0 200 OK``, ``SIP/2.0 486 Busy Here``); the last has ``Subscription-State:
terminated``. A 2xx sipfrag means the caller is now talking to the target: our call is over.

A :class:`Transfer` is one such REFER and its subscription. The call (call.py) owns it from
``CallControl.refer`` until it is done: the REFER refused or unanswered, a final sipfrag status
(2xx: succeeded, the call then ends with a BYE; 3xx-6xx: failed, the call goes on), or the
subscription terminated. Each status is handed to ``on_progress(status, reason, outcome)`` once,
in order; ``outcome`` is ``"pending"``, then ``"completed"`` (2xx sipfrag) or ``"failed"``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from .message import SipMessage

SIPFRAG_STATUS = re.compile(r"\s*SIP/2\.0 ([1-6]\d\d)(?: ([^\r\n]*))?")
REFER_EVENT = re.compile(r"\s*refer\s*(;|$)", re.IGNORECASE)
# A Refer-To URI goes into a header: nothing that could end it or start another.
TARGET = re.compile(r"(sips?|tel):[^\s<>\"\\,;]+(;[^\s<>\"\\,]+)*\Z", re.IGNORECASE)


def sipfrag_status(body: bytes) -> tuple[int, str] | None:
    """The status of a ``message/sipfrag`` body's first line, or None when it has none."""
    match = SIPFRAG_STATUS.match(body.decode("utf-8", "replace").split("\n", 1)[0])
    if match is None:
        return None
    return int(match.group(1)), (match.group(2) or "").strip()


def valid_target(uri: str) -> bool:
    """A ``sip:``, ``sips:`` or ``tel:`` URI without spaces, brackets, quotes or commas."""
    return bool(TARGET.match(uri)) and len(uri) <= 1024


class Transfer:
    """One REFER and its subscription (module doc)."""

    def __init__(self, target_uri: str, on_progress: Callable[[int, str, str], None],
                 log: logging.LoggerAdapter) -> None:
        self.target_uri = target_uri
        self._on_progress = on_progress
        self.log = log
        self.done = False
        self.succeeded = False
        self._last: tuple[int, str] | None = None

    def on_response(self, response: SipMessage | None) -> None:
        """The REFER's final response (None: no answer within 64*T1)."""
        if self.done:
            return
        status, reason = (response.status, response.reason) if response else (408, "Request Timeout")
        self.log.info("REFER to %s answered %d %s", self.target_uri, status, reason)
        if status >= 300:
            self.done = True
        self._report(status, reason)

    def on_notify(self, notify: SipMessage) -> int:
        """A NOTIFY of the subscription: the status to answer it with (200; 489 when it is not
        a refer event, 400 when its body holds no status line)."""
        if not REFER_EVENT.match(notify.get("event") or ""):
            return 489
        terminated = (notify.get("subscription-state") or "").strip().lower().startswith("terminated")
        status = sipfrag_status(notify.body)
        if status is None and not terminated:
            return 400
        if self.done:
            return 200  # a late or repeated NOTIFY: the transfer's outcome is known already
        if status is not None:
            self.log.info("transfer to %s: %d %s", self.target_uri, *status)
            final = status[0] >= 200
            self.succeeded = 200 <= status[0] < 300
            self.done = final or terminated
            if status != self._last:
                self._report(*status)
        elif terminated:  # ended without a final status: the transfer did not happen
            self.done = True
            self._report(487, "Subscription Terminated")
        return 200

    @property
    def outcome(self) -> str:
        return "completed" if self.succeeded else "failed" if self.done else "pending"

    def _report(self, status: int, reason: str) -> None:
        self._last = (status, reason)
        try:
            self._on_progress(status, reason, self.outcome)
        except Exception:  # the call's signalling must not fail on a listener
            self.log.exception("transfer progress listener failed")
