"""SDP offer/answer for one audio stream (RFC 4566, RFC 3264).

``negotiate(offer)`` reads the peer's offer and picks what the call will use: the first G.711
codec in the offer's order (PCMU or PCMA, by static payload type or by rtpmap), RFC 4733
telephone-event when offered, the peer's RTP address, and our direction (the mirror of theirs).
``answer(...)`` writes the answer: the same m= lines in the same order (RFC 3264 §6), every one
but the chosen audio stream rejected with port 0. ``offer(...)`` writes ours for a call we place
(dial.py): the codecs we answer with, PCMU first, and telephone-event; the callee's answer is then
read by ``negotiate`` as any SDP is (its first codec of ours, its address, the mirror of its
direction).

Plain values; the call (see call.py) keeps its :class:`Negotiated` and its o= line's version.
"""

from __future__ import annotations

from dataclasses import dataclass

# Static payload types of RFC 3551 we speak, and the names an rtpmap may give them.
STATIC = {0: "PCMU", 8: "PCMA"}
CODECS = ("PCMU", "PCMA")
CLOCK_RATE = 8000
DTMF_PT = 101  # the dynamic payload type our offers give telephone-event
_MIRROR = {"sendrecv": "sendrecv", "sendonly": "recvonly", "recvonly": "sendonly",
           "inactive": "inactive"}


class SdpError(ValueError):
    """An offer we cannot answer (no audio we speak, or not SDP at all): 488."""


@dataclass(frozen=True)
class MediaLine:
    """One m= line of the offer, with what we need from its attributes."""

    kind: str
    port: int
    proto: str
    formats: tuple[str, ...]
    rtpmap: dict[int, str]  # payload type -> "name/rate" as written (name upper-cased)
    direction: str
    address: str | None  # its c= line, else the session's


@dataclass(frozen=True)
class Negotiated:
    """What one offer/answer settled for the call's audio."""

    codec: str  # "PCMU" or "PCMA"
    payload_type: int
    dtmf_payload_type: int | None
    remote: tuple[str, int]  # where the peer wants our RTP
    direction: str  # ours, the mirror of the offer's: sendrecv, sendonly, recvonly, inactive
    held: bool  # the peer put the call on hold (sendonly / inactive / c=0.0.0.0)
    media_index: int  # which m= line carries the audio
    offer: tuple[MediaLine, ...]

    @property
    def may_send(self) -> bool:
        return self.direction in ("sendrecv", "sendonly")

    @property
    def expects_media(self) -> bool:
        """Whether the peer will send RTP (else the inbound-media timeout does not apply)."""
        return self.direction in ("sendrecv", "recvonly")


def parse_offer(text: str) -> tuple[MediaLine, ...]:
    """The m= lines of an SDP offer; raises :class:`SdpError` when it is not SDP."""
    lines = [line.strip() for line in text.replace("\r\n", "\n").split("\n") if line.strip()]
    if not lines or lines[0] != "v=0":
        raise SdpError("not an SDP session description")
    session_address: str | None = None
    session_direction = "sendrecv"
    media: list[dict] = []
    for line in lines[1:]:
        kind, eq, value = line.partition("=")
        if not eq or len(kind) != 1:
            raise SdpError(f"bad SDP line {line[:40]!r}")
        target = media[-1] if media else None
        if kind == "m":
            parts = value.split()
            if len(parts) < 4 or not parts[1].split("/")[0].isdigit():
                raise SdpError(f"bad m= line {value[:40]!r}")
            media.append({"kind": parts[0], "port": int(parts[1].split("/")[0]),
                          "proto": parts[2], "formats": tuple(parts[3:]), "rtpmap": {},
                          "direction": None, "address": None})
        elif kind == "c":
            parts = value.split()
            if len(parts) != 3 or parts[0] != "IN" or parts[1] not in ("IP4", "IP6"):
                raise SdpError(f"bad c= line {value[:40]!r}")
            address = parts[2].split("/")[0]  # drop a multicast TTL
            if target is None:
                session_address = address
            else:
                target["address"] = address
        elif kind == "a":
            name, _, arg = value.partition(":")
            if name in _MIRROR:
                if target is None:
                    session_direction = name
                else:
                    target["direction"] = name
            elif name == "rtpmap" and target is not None:
                pt, _, encoding = arg.partition(" ")
                if pt.isdigit():
                    target["rtpmap"][int(pt)] = encoding.strip().upper()
    return tuple(
        MediaLine(m["kind"], m["port"], m["proto"], m["formats"], m["rtpmap"],
                  m["direction"] or session_direction, m["address"] or session_address)
        for m in media
    )


def negotiate(text: str) -> Negotiated:
    """Choose codec, DTMF, address and direction from an offer; raises :class:`SdpError` (488)."""
    offer = parse_offer(text)
    for index, line in enumerate(offer):
        if line.kind != "audio" or line.proto != "RTP/AVP" or line.port == 0:
            continue
        if line.address is None:
            raise SdpError("audio without a connection address")
        chosen = _codec(line)
        if chosen is None:
            continue
        codec, pt = chosen
        # RFC 3264 §8.4: 0.0.0.0 is the old way to put a call on hold.
        held = line.direction in ("sendonly", "inactive") or line.address == "0.0.0.0"
        return Negotiated(
            codec=codec, payload_type=pt, dtmf_payload_type=_dtmf(line),
            remote=(line.address, line.port), direction=_MIRROR[line.direction], held=held,
            media_index=index, offer=offer,
        )
    raise SdpError("no audio stream with PCMU or PCMA")


def _codec(line: MediaLine) -> tuple[str, int] | None:
    for fmt in line.formats:
        if not fmt.isdigit():
            continue
        pt = int(fmt)
        name = line.rtpmap.get(pt, "")
        if name:
            codec, _, rate = name.partition("/")
            if codec in CODECS and rate.split("/")[0] == str(CLOCK_RATE):
                return codec, pt
        elif pt in STATIC:
            return STATIC[pt], pt
    return None


def _dtmf(line: MediaLine) -> int | None:
    for fmt in line.formats:
        if fmt.isdigit() and line.rtpmap.get(int(fmt)) == f"TELEPHONE-EVENT/{CLOCK_RATE}":
            return int(fmt)
    return None


def _session_lines(address: str, session_id: int, version: int) -> list[str]:
    """The session-level lines of our SDP (an answer's or an offer's) for media on ``address``."""
    family = "IP6" if ":" in address else "IP4"
    return ["v=0", f"o=duplex {session_id} {version} IN {family} {address}", "s=duplex",
            f"c=IN {family} {address}", "t=0 0"]


def answer(neg: Negotiated, address: str, port: int, session_id: int, version: int) -> str:
    """Our SDP answer: the chosen audio on ``address:port``, every other m= line rejected."""
    lines = _session_lines(address, session_id, version)
    for index, line in enumerate(neg.offer):
        if index != neg.media_index:
            lines.append(f"m={line.kind} 0 {line.proto} {' '.join(line.formats)}")
            continue
        formats = [neg.payload_type]
        if neg.dtmf_payload_type is not None:
            formats.append(neg.dtmf_payload_type)
        lines.append(f"m=audio {port} RTP/AVP {' '.join(map(str, formats))}")
        lines.append(f"a=rtpmap:{neg.payload_type} {neg.codec}/{CLOCK_RATE}")
        if neg.dtmf_payload_type is not None:
            lines.append(f"a=rtpmap:{neg.dtmf_payload_type} telephone-event/{CLOCK_RATE}")
            lines.append(f"a=fmtp:{neg.dtmf_payload_type} 0-15")
        lines.append("a=ptime:20")
        lines.append(f"a={neg.direction}")
    return "\r\n".join(lines) + "\r\n"


def offer(address: str, port: int, session_id: int, version: int) -> str:
    """Our SDP offer for a call we place: PCMU, PCMA and telephone-event on ``address:port``."""
    static = " ".join(str(pt) for pt in STATIC)
    lines = [
        *_session_lines(address, session_id, version),
        f"m=audio {port} RTP/AVP {static} {DTMF_PT}",
        *(f"a=rtpmap:{pt} {name}/{CLOCK_RATE}" for pt, name in STATIC.items()),
        f"a=rtpmap:{DTMF_PT} telephone-event/{CLOCK_RATE}",
        f"a=fmtp:{DTMF_PT} 0-15",
        "a=ptime:20",
        "a=sendrecv",
    ]
    return "\r\n".join(lines) + "\r\n"
