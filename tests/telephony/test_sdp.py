"""SDP offer/answer: codec choice, DTMF, rejected streams, directions and hold."""

from __future__ import annotations

import pytest

from duplex.transports.sip.sdp import SdpError, answer, negotiate, parse_offer


def offer(*media: str, session: str = "c=IN IP4 192.0.2.10") -> str:
    return "\r\n".join(["v=0", "o=- 1 1 IN IP4 192.0.2.10", "s=-", session, "t=0 0", *media]) + "\r\n"


def test_prefers_the_offers_order():
    neg = negotiate(offer("m=audio 5004 RTP/AVP 8 0 101", "a=rtpmap:101 telephone-event/8000"))
    assert (neg.codec, neg.payload_type, neg.dtmf_payload_type) == ("PCMA", 8, 101)
    assert neg.remote == ("192.0.2.10", 5004) and neg.direction == "sendrecv" and not neg.held
    neg = negotiate(offer("m=audio 5004 RTP/AVP 18 0 8"))
    assert (neg.codec, neg.dtmf_payload_type) == ("PCMU", None)


def test_dynamic_payload_type_by_rtpmap():
    neg = negotiate(offer("m=audio 5004 RTP/AVP 96 97", "a=rtpmap:96 opus/48000/2",
                          "a=rtpmap:97 pcmu/8000"))
    assert (neg.codec, neg.payload_type) == ("PCMU", 97)


def test_answer_keeps_the_lines_and_rejects_other_media():
    neg = negotiate(offer("m=video 5006 RTP/AVP 96", "a=rtpmap:96 VP8/90000",
                          "m=audio 5004 RTP/AVP 0 101", "c=IN IP4 192.0.2.11",
                          "a=rtpmap:101 telephone-event/8000", "a=sendrecv",
                          "m=audio 5008 RTP/SAVP 0"))
    assert neg.remote == ("192.0.2.11", 5004) and neg.media_index == 1
    text = answer(neg, "198.51.100.1", 40000, session_id=7, version=2)
    assert "o=duplex 7 2 IN IP4 198.51.100.1" in text and "c=IN IP4 198.51.100.1" in text
    lines = parse_offer(text)
    assert [(m.kind, m.port, m.proto, m.formats) for m in lines] == [
        ("video", 0, "RTP/AVP", ("96",)),
        ("audio", 40000, "RTP/AVP", ("0", "101")),
        ("audio", 0, "RTP/SAVP", ("0",)),
    ]
    assert lines[1].rtpmap == {0: "PCMU/8000", 101: "TELEPHONE-EVENT/8000"}
    assert "a=fmtp:101 0-15" in text and "a=ptime:20" in text
    assert lines[1].direction == "sendrecv"


@pytest.mark.parametrize(("theirs", "ours", "held"), [
    ("a=sendrecv", "sendrecv", False),
    ("a=sendonly", "recvonly", True),
    ("a=inactive", "inactive", True),
    ("a=recvonly", "sendonly", False),
])
def test_direction_mirrors_the_offer(theirs, ours, held):
    neg = negotiate(offer("m=audio 5004 RTP/AVP 0", theirs))
    assert neg.direction == ours and neg.held == held
    assert f"a={ours}" in answer(neg, "127.0.0.1", 40000, 1, 1)


def test_session_level_direction_and_old_style_hold():
    neg = negotiate(offer("m=audio 5004 RTP/AVP 0", session="c=IN IP4 0.0.0.0"))
    assert neg.held and neg.remote[0] == "0.0.0.0"
    neg = negotiate("v=0\r\no=- 1 1 IN IP4 h\r\ns=-\r\nc=IN IP4 192.0.2.1\r\nt=0 0\r\n"
                    "a=inactive\r\nm=audio 5004 RTP/AVP 0\r\n")
    assert neg.direction == "inactive" and neg.held


@pytest.mark.parametrize("text", [
    "",
    "not sdp",
    offer("m=audio 5004 RTP/AVP 18"),  # G.729 only
    offer("m=audio 0 RTP/AVP 0"),  # the offerer disabled its audio
    offer("m=video 5004 RTP/AVP 96"),
    offer("m=audio 5004 RTP/AVP 0", session=""),  # no connection address
    offer("m=audio x RTP/AVP 0"),
])
def test_unacceptable_offers(text):
    with pytest.raises(SdpError):
        negotiate(text)
