"""SIP messages (RFC 3261 §7): a small, strict parser and the serialiser for what we send.

``parse`` frames one UDP datagram into a :class:`SipMessage` (start line, headers, body). It is
strict where leniency would be ambiguous (several Content-Length values, a Content-Length larger
than the datagram, spaces inside the Request-URI, a CSeq number past 2**31) and lenient where RFC
3261 asks for it (header folding, compact header names, any case in header names, LWS around the
colon, bodies longer than Content-Length are cut to it). What it cannot frame at all raises
:class:`SipParseError` with ``status=None``: the datagram is dropped. What it frames but finds
wrong raises it with a status and the framed ``message``, so the caller can answer the 4xx.

Messages are plain values; nothing here holds state between datagrams.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SIP_VERSION = "SIP/2.0"
# RFC 3261 §25.1 token characters (methods, header names, option tags, parameter names).
_TOKEN = re.compile(r"[A-Za-z0-9\-.!%*_+`'~]+\Z")
_COMPACT = {
    "i": "call-id", "m": "contact", "e": "content-encoding", "l": "content-length",
    "c": "content-type", "f": "from", "s": "subject", "k": "supported", "t": "to", "v": "via",
}
# Headers that hold one value: a second occurrence makes the request ambiguous (RFC 4475 §3.1.2.6).
_SINGLE = ("call-id", "cseq", "from", "to", "max-forwards", "content-length", "content-type")
# Headers whose comma-separated values are separate entries (RFC 3261 §7.3.1).
_LISTS = {"via", "route", "record-route", "require", "supported", "allow", "accept", "contact",
          "proxy-require", "content-encoding", "unsupported"}
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')  # a quoted-string, escapes included
_REQUIRED = ("via", "from", "to", "call-id", "cseq")
_URI_SCHEMES = ("sip", "sips", "tel")
MAX_CSEQ = 2**31 - 1  # RFC 3261 §8.1.1.5: the sequence number must be below 2**31


class SipParseError(ValueError):
    """A datagram that is not an acceptable SIP message.

    ``status`` is the response to send (400, 416, 505) or None when nothing can be answered;
    ``message`` is what could be framed, to build that response from.
    """

    def __init__(self, reason: str, status: int | None = None,
                 message: SipMessage | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.message = message


@dataclass
class SipMessage:
    """A request (``method`` and ``uri`` set) or a response (``status`` and ``reason`` set)."""

    method: str = ""
    uri: str = ""
    status: int = 0
    reason: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)  # (lower-case full name, value)
    body: bytes = b""

    @property
    def is_request(self) -> bool:
        return bool(self.method)

    def get(self, name: str) -> str | None:
        """The first value of header ``name`` (any case, compact or full form), or None."""
        values = self.get_all(name)
        return values[0] if values else None

    def get_all(self, name: str) -> list[str]:
        """Every value of ``name``, list headers split at their top-level commas."""
        name = _canonical(name)
        values: list[str] = []
        for key, value in self.headers:
            if key == name:
                values.extend(split_commas(value) if name in _LISTS else [value])
        return values

    @property
    def call_id(self) -> str:
        return self.get("call-id") or ""

    @property
    def cseq(self) -> tuple[int, str]:
        """(number, method); only valid on a message ``parse`` accepted."""
        number, method = (self.get("cseq") or "0 -").split()
        return int(number), method

    @property
    def from_tag(self) -> str | None:
        return param(self.get("from") or "", "tag")

    @property
    def to_tag(self) -> str | None:
        return param(self.get("to") or "", "tag")

    @property
    def branch(self) -> str:
        return param(self.get("via") or "", "branch") or ""

    def serialise(self) -> bytes:
        start = (f"{self.method} {self.uri} {SIP_VERSION}" if self.is_request
                 else f"{SIP_VERSION} {self.status} {self.reason}")
        lines = [start]
        lines += [f"{display_name(name)}: {value}" for name, value in self.headers
                  if name != "content-length"]
        lines.append(f"Content-Length: {len(self.body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + self.body


def parse(data: bytes) -> SipMessage:
    """Frame one datagram; raises :class:`SipParseError` (see module doc)."""
    # RFC 3261 §7.5: CRLFs before the start line are ignored.
    head, sep, body = data.lstrip(b"\r\n").partition(b"\r\n\r\n")
    if not sep:
        # A message without a body may arrive without the blank line's CRLF being doubled only
        # when it is cut short; without the end of the headers we cannot tell where they stop.
        raise SipParseError("no end of headers")
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SipParseError("headers are not UTF-8") from exc
    lines = _unfold(text.split("\r\n"))
    start_error: SipParseError | None = None
    try:
        msg = _start_line(lines[0])
    except SipParseError as exc:
        if exc.message is None:
            raise
        # Read the headers all the same: the 400 needs the Via, Call-ID and CSeq.
        msg, start_error = exc.message, exc
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        name = name.rstrip(" \t")
        if not colon or not _TOKEN.match(name):
            raise SipParseError(f"bad header line {line[:40]!r}", 400, msg)
        msg.headers.append((_canonical(name), value.strip(" \t")))
    msg.body = body
    if start_error is not None:
        raise start_error
    _check(msg)
    return msg


def _unfold(lines: list[str]) -> list[str]:
    """Join continuation lines (leading SP/HT) to the header they continue (RFC 3261 §7.3.1)."""
    out: list[str] = []
    for line in lines:
        if line[:1] in (" ", "\t") and len(out) > 1:
            out[-1] += " " + line.strip(" \t")
        else:
            out.append(line)
    return out


def _start_line(line: str) -> SipMessage:
    if line.startswith("SIP/"):
        version, _, rest = line.partition(" ")
        code, _, reason = rest.partition(" ")
        if version != SIP_VERSION or not (len(code) == 3 and code.isdigit()) or code[0] == "0":
            raise SipParseError(f"bad status line {line[:40]!r}")
        return SipMessage(status=int(code), reason=reason)
    parts = line.split(" ")
    if len(parts) != 3 or not _TOKEN.match(parts[0]):
        # Spaces in the Request-URI (RFC 4475 §3.1.2.7) land here too: answerable once the
        # headers are known, so the method is kept when it looks like one.
        method = parts[0] if _TOKEN.match(parts[0] or "-") else ""
        raise SipParseError(f"bad request line {line[:40]!r}", 400 if method else None,
                            SipMessage(method=method, uri="-") if method else None)
    method, uri, version = parts
    return SipMessage(method=method, uri=uri, reason=version)  # version checked in _check


def _check(msg: SipMessage) -> None:
    """Framing rules every accepted message obeys; raises with a status to answer."""
    try:
        lengths = {int(v) if v.isdigit() else -1 for v in msg.get_all("content-length")}
    except ValueError:
        lengths = {-1}
    if -1 in lengths or len(lengths) > 1:
        _fail(msg, "bad Content-Length")
    if lengths:
        length = lengths.pop()
        if length > len(msg.body):
            _fail(msg, "Content-Length larger than the message")
        # UDP (RFC 3261 §18.3): bytes past Content-Length are discarded.
        msg.body = msg.body[:length]
    if not msg.is_request:
        if any(not msg.get(name) for name in _REQUIRED) or _cseq_bad(msg):
            raise SipParseError("response without the headers to match it")
        return
    if msg.reason != SIP_VERSION:
        version = msg.reason
        msg.reason = ""
        raise SipParseError(f"unsupported version {version!r}", 505, msg)
    msg.reason = ""
    missing = [name for name in _REQUIRED if not msg.get(name)]
    if missing:
        _fail(msg, f"missing {', '.join(missing)}")
    repeated = [name for name in _SINGLE if len([k for k, _ in msg.headers if k == name]) > 1]
    if repeated:
        _fail(msg, f"repeated {', '.join(repeated)}")
    if _cseq_bad(msg):
        _fail(msg, "bad CSeq")
    if msg.cseq[1] != msg.method:
        _fail(msg, "CSeq method does not match the request")
    forwards = msg.get("max-forwards")
    if forwards is not None and not (forwards.isdigit() and int(forwards) <= 255):
        _fail(msg, "bad Max-Forwards")
    for name in ("from", "to"):
        if not _name_addr_ok(msg.get(name) or ""):
            _fail(msg, f"bad {name} header")
    if any(c in msg.uri for c in "<>\"") or ":" not in msg.uri:
        _fail(msg, "bad Request-URI")
    if msg.uri.split(":", 1)[0].lower() not in _URI_SCHEMES:
        raise SipParseError("unsupported URI scheme", 416, msg)


def _fail(msg: SipMessage, reason: str) -> None:
    raise SipParseError(reason, 400, msg)


def _cseq_bad(msg: SipMessage) -> bool:
    parts = (msg.get("cseq") or "").split()
    return not (len(parts) == 2 and parts[0].isdigit() and int(parts[0]) <= MAX_CSEQ
                and _TOKEN.match(parts[1]))


def _name_addr_ok(value: str) -> bool:
    """Balanced quotes, at most one <...> after them, and a URI with a scheme."""
    unquoted = _QUOTED.sub("", value)
    if '"' in unquoted:
        return False
    if "<" in unquoted or ">" in unquoted:
        match = re.fullmatch(r"[^<>]*<([^<>]+)>[^<>]*", unquoted)
        return bool(match) and ":" in match.group(1)
    return ":" in unquoted.split(";", 1)[0]


def split_commas(value: str) -> list[str]:
    """Split a header value at commas outside quotes and <...>."""
    parts, depth, quoted, start, escaped = [], 0, False, 0, False
    for i, ch in enumerate(value):
        if escaped:
            escaped = False
        elif ch == "\\" and quoted:
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif not quoted and ch == "<":
            depth += 1
        elif not quoted and ch == ">":
            depth = max(depth - 1, 0)
        elif not quoted and depth == 0 and ch == ",":
            parts.append(value[start:i].strip())
            start = i + 1
    parts.append(value[start:].strip())
    return [p for p in parts if p]


def params(value: str) -> dict[str, str]:
    """The header parameters of a name-addr or Via value (after ``>`` if any), names lower-cased."""
    unquoted = _QUOTED.sub('""', value)
    tail = unquoted[unquoted.rfind(">") + 1:] if ">" in unquoted else unquoted
    out: dict[str, str] = {}
    for item in tail.split(";")[1:]:
        name, _, val = item.partition("=")
        out[name.strip().lower()] = val.strip()
    return out


def param(value: str, name: str) -> str | None:
    return params(value).get(name)


def uri_of(value: str) -> str:
    """The URI inside a name-addr (``"Bob" <sip:bob@h>;tag=1`` → ``sip:bob@h``) or addr-spec."""
    unquoted = _QUOTED.sub('""', value)
    match = re.search(r"<([^<>]*)>", unquoted)
    return match.group(1) if match else unquoted.split(";", 1)[0].strip()


def _canonical(name: str) -> str:
    name = name.lower()
    return _COMPACT.get(name, name)


def display_name(name: str) -> str:
    """A header name as SIP messages usually spell it (``call-id`` → ``Call-ID``)."""
    special = {"call-id": "Call-ID", "cseq": "CSeq", "www-authenticate": "WWW-Authenticate"}
    return special.get(name) or "-".join(part.capitalize() for part in name.split("-"))
