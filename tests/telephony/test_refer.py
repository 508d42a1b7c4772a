"""A transfer's bookkeeping (duplex/transports/sip/refer.py) on messages whose content is known:
the REFER's answers and the NOTIFYs a referee sends (the full exchange with sipp is in
tests/operators/test_call_webhook.py)."""

from __future__ import annotations

import logging

import pytest

from duplex.transports.sip.message import SipMessage
from duplex.transports.sip.refer import Transfer, sipfrag_status, valid_target

LOG = logging.LoggerAdapter(logging.getLogger(__name__), {})


def notify(body: str, state: str = "active;expires=60", event: str = "refer") -> SipMessage:
    return SipMessage(method="NOTIFY", uri="sip:a@b", body=body.encode(), headers=[
        ("event", event), ("subscription-state", state),
        ("content-type", "message/sipfrag;version=2.0")])


def transfer() -> tuple[Transfer, list[tuple[int, str, str]]]:
    seen: list[tuple[int, str, str]] = []
    return Transfer("sip:desk@example", lambda *args: seen.append(args), LOG), seen


@pytest.mark.parametrize(("body", "status"), [
    (b"SIP/2.0 200 OK\r\n", (200, "OK")), (b"SIP/2.0 180 Ringing", (180, "Ringing")),
    (b"SIP/2.0 503 Service Unavailable\r\nRetry-After: 5\r\n", (503, "Service Unavailable")),
    (b"SIP/2.0 100\r\n", (100, "")), (b"HTTP/1.1 200 OK", None), (b"", None), (b"SIP/2.0 99 x", None),
])
def test_sipfrag_status_lines(body: bytes, status: tuple[int, str] | None) -> None:
    assert sipfrag_status(body) == status


@pytest.mark.parametrize(("uri", "ok"), [
    ("sip:desk@pbx.example", True), ("sips:+14155550123@trunk.example;user=phone", True),
    ("tel:+14155550123", True), ("sip:desk@pbx.example;transport=tcp?X-Ref=7", True),
    ("http://pbx.example", False), ("sip:", False), ("sip:a b@x", False),
    ("sip:a@x>\r\nX-Evil: 1", False), ("sip:a@x\r\n", False), ('sip:"a"@x', False),
    ("sip:a@x, sip:b@y", False), ("sip:" + "a" * 1100, False),
])
def test_only_plain_sip_sips_and_tel_targets(uri: str, ok: bool) -> None:
    assert valid_target(uri) is ok


def test_a_successful_transfer_reports_each_status_once() -> None:
    t, seen = transfer()
    t.on_response(SipMessage(status=202, reason="Accepted"))
    assert t.on_notify(notify("SIP/2.0 100 Trying")) == 200
    assert t.on_notify(notify("SIP/2.0 100 Trying")) == 200  # the same state again: reported once
    assert t.on_notify(notify("SIP/2.0 200 OK", "terminated;reason=noresource")) == 200
    assert seen == [(202, "Accepted", "pending"), (100, "Trying", "pending"), (200, "OK", "completed")]
    assert t.done and t.succeeded
    assert t.on_notify(notify("SIP/2.0 200 OK", "terminated")) == 200 and len(seen) == 3


def test_a_busy_target_fails_the_transfer() -> None:
    t, seen = transfer()
    t.on_notify(notify("SIP/2.0 180 Ringing"))  # a NOTIFY may come before the REFER's 202
    t.on_response(SipMessage(status=202, reason="Accepted"))
    t.on_notify(notify("SIP/2.0 486 Busy Here", "terminated"))
    assert seen[-1] == (486, "Busy Here", "failed") and t.done and not t.succeeded


def test_a_refused_or_unanswered_refer_fails_it() -> None:
    t, seen = transfer()
    t.on_response(SipMessage(status=603, reason="Decline"))
    assert seen == [(603, "Decline", "failed")] and t.done
    t, seen = transfer()
    t.on_response(None)
    assert seen == [(408, "Request Timeout", "failed")]


def test_an_ended_subscription_without_a_final_status_fails_it() -> None:
    t, seen = transfer()
    t.on_response(SipMessage(status=202, reason="Accepted"))
    assert t.on_notify(notify("", "terminated;reason=timeout")) == 200
    assert seen[-1] == (487, "Subscription Terminated", "failed")


def test_notifies_that_are_not_the_transfers() -> None:
    t, seen = transfer()
    assert t.on_notify(notify("SIP/2.0 200 OK", event="presence")) == 489
    assert t.on_notify(notify("nothing")) == 400
    assert not seen and not t.done
