"""The SIP parser on torture messages in the manner of RFC 4475 (written for these tests).

Each case names the RFC 4475 section whose trap it sets. Valid messages must parse with the
right values; invalid ones must raise with the status a UAS answers (None: dropped).
"""

from __future__ import annotations

import pytest

from duplex.transports.sip.message import SipParseError, parse, split_commas, uri_of
from duplex.transports.sip.transaction import response


def msg(*lines: str, body: str = "") -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n" + body).encode()


BASE = (
    "Via: SIP/2.0/UDP 192.0.2.7:5060;branch=z9hG4bKabc",
    "Max-Forwards: 70",
    "From: <sip:caller@example.com>;tag=f1",
    "To: <sip:agent@example.com>",
    "Call-ID: c1@192.0.2.7",
)


def test_tortuous_but_valid_invite():
    """§3.1.1.1: compact names, odd case and LWS, folding, a quoted display name with specials,
    params in odd places, a body longer than Content-Length on UDP."""
    data = msg(
        "INVITE sip:agent@example.com;user=phone SIP/2.0",
        "v:  SIP/2.0/UDP 192.0.2.7:5060 ;branch = z9hG4bK-x1 ;rport",
        "TO :",
        "  <sip:agent@example.com> ; tag = \t",
        "  to7",
        'f: "J. \\"Caller\\" <x>, y" <sip:caller@example.com;lr>;tag=f1',
        "i: folded-c1",
        "cSeQ:   8",
        "  INVITE",
        "Max-Forwards: 68",
        "Via: SIP/2.0/UDP 192.0.2.8;branch=z9hG4bKb2, SIP/2.0/UDP 192.0.2.9;branch=z9hG4bKb3",
        "NewFangledHeader:   newfangled value",
        "  continued newfangled value",
        "c: application/sdp",
        "l: 7",
        body="v=0\r\n\r\nextra bytes past the length",
    )
    m = parse(data)
    assert m.method == "INVITE" and m.uri == "sip:agent@example.com;user=phone"
    assert m.call_id == "folded-c1" and m.cseq == (8, "INVITE")
    assert m.to_tag == "to7" and m.from_tag == "f1"
    assert len(m.get_all("via")) == 3 and m.branch == "z9hG4bK-x1"
    assert m.get("newfangledheader") == "newfangled value continued newfangled value"
    assert m.body == b"v=0\r\n\r\n"
    assert uri_of(m.get("from")) == "sip:caller@example.com;lr"


@pytest.mark.parametrize("method", ["!interesting-Method0123456789_*+`.%indeed'~", "NEWMETHOD"])
def test_unknown_method_tokens_parse(method):
    """§3.1.1.5: any token is a method (the UAS then answers 405)."""
    m = parse(msg(f"{method} sip:agent@example.com SIP/2.0", *BASE, f"CSeq: 1 {method}",
                  "Content-Length: 0"))
    assert m.method == method


def test_escapes_and_semicolons_in_uris_pass_through():
    """§3.1.1.3 / 3.1.1.10: %-escapes and ';' in the user part are the URI's business."""
    m = parse(msg("OPTIONS sip:user;par=u%40example.net@example.com SIP/2.0", *BASE,
                  "CSeq: 1 OPTIONS", "Content-Length: 0"))
    assert m.uri == "sip:user;par=u%40example.net@example.com"


def test_leading_crlf_and_no_content_length():
    """RFC 3261 §7.5: CRLFs before the start line are ignored; on UDP Content-Length may lack."""
    m = parse(b"\r\n\r\n" + msg("OPTIONS sip:a@example.com SIP/2.0", *BASE, "CSeq: 1 OPTIONS"))
    assert m.method == "OPTIONS" and m.body == b""


def test_response_parses():
    m = parse(msg("SIP/2.0 200 OK with, spaces", *BASE, "CSeq: 2 BYE"))
    assert not m.is_request and m.status == 200 and m.cseq == (2, "BYE")


@pytest.mark.parametrize(("name", "lines", "status"), [
    # §3.1.2.1 Content-Length larger than the message
    ("clerr", ["INVITE sip:a@example.com SIP/2.0", *BASE, "CSeq: 1 INVITE",
               "Content-Length: 9999"], 400),
    # §3.1.2.2 a negative Content-Length
    ("ncl", ["INVITE sip:a@example.com SIP/2.0", *BASE, "CSeq: 1 INVITE",
             "Content-Length: -1"], 400),
    # §3.1.2.3 a CSeq number too large for 32 bits
    ("scalar", ["OPTIONS sip:a@example.com SIP/2.0", *BASE,
                "CSeq: 36893488147419103232 OPTIONS"], 400),
    # §3.1.2.4 unbalanced quotes in a display name
    ("quotbal", ["OPTIONS sip:a@example.com SIP/2.0", *BASE[:2],
                 'From: "Bob <sip:caller@example.com>;tag=f1', *BASE[3:],
                 "CSeq: 1 OPTIONS"], 400),
    # §3.1.2.5 <> around the Request-URI
    ("ltgtruri", ["OPTIONS <sip:a@example.com> SIP/2.0", *BASE, "CSeq: 1 OPTIONS"], 400),
    # §3.1.2.6 LWS inside the Request-URI
    ("lwsruri", ["OPTIONS sip:a@example.com; lr SIP/2.0", *BASE, "CSeq: 1 OPTIONS"], 400),
    # §3.1.2.7 several spaces between the elements of the request line
    ("lwsstart", ["OPTIONS  sip:a@example.com  SIP/2.0", *BASE, "CSeq: 1 OPTIONS"], 400),
    # §3.1.2.11 several values in a header that holds one
    ("multi", ["OPTIONS sip:a@example.com SIP/2.0", *BASE, "To: <sip:other@example.com>",
               "CSeq: 1 OPTIONS"], 400),
    # §3.1.2.10 two differing Content-Lengths
    ("mcl", ["INVITE sip:a@example.com SIP/2.0", *BASE, "CSeq: 1 INVITE",
             "Content-Length: 0", "l: 3"], 400),
    # §3.1.2.14 a SIP version we do not speak
    ("badvers", ["OPTIONS sip:a@example.com SIP/7.0", *BASE, "CSeq: 1 OPTIONS"], 505),
    # §3.1.2.15 the CSeq method differs from the request's
    ("mismatch", ["OPTIONS sip:a@example.com SIP/2.0", *BASE, "CSeq: 1 INVITE"], 400),
    # §3.3.15 the Request-URI's scheme is unknown
    ("novelsc", ["OPTIONS soap.beep://192.0.2.103:3002 SIP/2.0", *BASE, "CSeq: 1 OPTIONS"], 416),
    # §3.1.2.18 / 3.3.12: missing required headers (no Call-ID, no CSeq)
    ("insuf", ["OPTIONS sip:a@example.com SIP/2.0", *BASE[:4]], 400),
    # a non-numeric Max-Forwards
    ("maxfwd", ["OPTIONS sip:a@example.com SIP/2.0", *BASE[:1], "Max-Forwards: many",
                *BASE[2:], "CSeq: 1 OPTIONS"], 400),
    # a header line without a colon
    ("nocolon", ["OPTIONS sip:a@example.com SIP/2.0", *BASE, "CSeq 1 OPTIONS"], 400),
])
def test_invalid_requests_get_their_status(name, lines, status):
    with pytest.raises(SipParseError) as caught:
        parse(msg(*lines))
    assert caught.value.status == status, (name, caught.value.reason)
    # Whatever the fault, the answer can be built and carries the request's Via.
    answer = response(caught.value.message, status, ("192.0.2.7", 5060), to_tag="t")
    assert answer.serialise().startswith(f"SIP/2.0 {status} ".encode())


@pytest.mark.parametrize("data", [
    b"",
    b"\x00\x01\x02",
    b"garbage without an end of headers",
    b"INVITE sip:a@example.com SIP/2.0\r\nVia: x",  # cut short
    b"SIP/2.0 99 Too small\r\n\r\n",
    b"SIP/2.0 200 OK\r\nCall-ID: x\r\n\r\n",  # a response we could not match
    b"\xff\xfe INVITE sip:a SIP/2.0\r\n\r\n",  # not UTF-8
    b"INVITE sip:a@example.com SIP/2.0\r\nVia: SIP/2.0/UDP h\r\n " * 300,
])
def test_unparseable_datagrams_raise_without_status(data):
    with pytest.raises(SipParseError) as caught:
        parse(data)
    assert caught.value.status is None or caught.value.message is not None


def test_split_commas_respects_quotes_and_brackets():
    value = '"a, b" <sip:x@h;p=1,2>;tag=1, <sip:y@h>'
    assert split_commas(value) == ['"a, b" <sip:x@h;p=1,2>;tag=1', "<sip:y@h>"]


def test_response_marks_the_source_and_adds_our_tag():
    request = parse(msg("OPTIONS sip:a@example.com SIP/2.0",
                        "Via: SIP/2.0/UDP 10.1.1.1:5062;rport;branch=z9hG4bK1",
                        "Via: SIP/2.0/UDP proxy.example.com;branch=z9hG4bK0", *BASE[1:],
                        "CSeq: 1 OPTIONS"))
    answer = parse(response(request, 200, ("192.0.2.7", 40000), to_tag="ours").serialise())
    vias = answer.get_all("via")
    assert vias[0] == "SIP/2.0/UDP 10.1.1.1:5062;rport=40000;branch=z9hG4bK1;received=192.0.2.7"
    assert vias[1] == "SIP/2.0/UDP proxy.example.com;branch=z9hG4bK0"
    assert answer.to_tag == "ours" and answer.cseq == (1, "OPTIONS")
    assert answer.get("content-length") == "0"
