"""Twilio's request signature (``X-Twilio-Signature``, ``--twilio-auth-token``) and the public URL
it covers.

Twilio signs each request with the account's auth token: base64(HMAC-SHA1(auth token, the full URL
it requested, then for a POST form body every parameter name followed by its value, sorted by name
case-sensitively)). A WebSocket handshake is a GET: the signed string is the ``wss://`` URL alone.
Behind a reverse proxy Twilio signed the public URL, so the URL is rebuilt from the request's
``X-Forwarded-Proto`` (else its own scheme) and ``Host`` header, the same way the voice webhook
names the stream in its TwiML. Twilio's own validators also accept the URL with its port removed or
the scheme's default port added (Twilio has signed both forms); so does :func:`signature_ok`.

Hand-written rather than the ``twilio`` package's ``RequestValidator``: that package is Twilio's
REST client (it brings aiohttp, requests and PyJWT) and the check is a dozen lines of ``hmac``.
Stateless: nothing here lives beyond a call.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

SIGNATURE_HEADER = "X-Twilio-Signature"  # looked up case-insensitively
_DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}


def public_origin(connection: HTTPConnection, websocket: bool) -> str:
    """``scheme://host`` as the client addressed this server: ``ws``/``wss`` when ``websocket``,
    else ``http``/``https``, secure when the proxy's ``X-Forwarded-Proto`` (else the connection's
    own scheme) says so."""
    proto = connection.headers.get("x-forwarded-proto", connection.url.scheme)
    secure = proto.split(",")[0].strip().lower() in ("https", "wss")
    scheme = ("wss" if secure else "ws") if websocket else ("https" if secure else "http")
    return f"{scheme}://{connection.headers.get('host', connection.url.netloc)}"


def public_url(connection: HTTPConnection) -> str:
    """The full URL (path and query string as received) the client requested."""
    websocket = connection.scope["type"] == "websocket"
    path = connection.scope.get("raw_path") or connection.scope["path"].encode()
    query = connection.scope.get("query_string", b"")
    url = public_origin(connection, websocket) + path.decode("latin-1")
    return f"{url}?{query.decode('latin-1')}" if query else url


def signature(auth_token: str, url: str, params: Iterable[tuple[str, str]] = ()) -> str:
    """Twilio's signature of a request to ``url`` with these form parameters (see module doc)."""
    signed = url + "".join(name + value for name, value in sorted(params))
    digest = hmac.new(auth_token.encode(), signed.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode("ascii")


def signature_ok(auth_token: str, url: str, params: Iterable[tuple[str, str]],
                 given: str | None) -> bool:
    """Whether ``given`` (the header's value) is Twilio's signature of the request, for the URL as
    received, without its port or with the default port (constant-time comparisons)."""
    if not given:
        return False
    params = list(params)
    expected = (signature(auth_token, candidate, params) for candidate in _port_variants(url))
    return any(hmac.compare_digest(e.encode(), given.encode()) for e in expected)


def _port_variants(url: str) -> list[str]:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal goes back into brackets
        host = f"[{host}]"
    default = _DEFAULT_PORTS.get(parts.scheme)
    without = parts._replace(netloc=host).geturl()
    with_default = parts._replace(netloc=f"{host}:{default}").geturl() if default else without
    return list(dict.fromkeys([url, without, with_default]))
