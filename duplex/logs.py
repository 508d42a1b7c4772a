"""Logging for the server and its stage processes: one format, with the session id on every line
that has one (``LoggerAdapter(log, {"session_id": ...})``) and ``-`` elsewhere, and no secret on
any line.

Secrets are masked where a record becomes text (:class:`RedactingFormatter`), so that what every
library logs (uvicorn's access lines with their query strings, websockets' DEBUG dump of handshake
headers and frames, aiortc) passes the same two checks:

- by shape: the value of any field named like a credential (``?token=…``, ``"api_key": "…"``,
  ``Authorization: Bearer …``, ``credential='…'``), the key in OpenAI's browser subprotocol, the
  password in a URL's user info, ephemeral client secrets (``ek_…``): whoever's secret it is,
  a client's wrong key included;
- by value, as the last line of defence: every secret the server was configured with
  (:func:`hide_secrets`), wherever it appears.

The process has one :data:`REDACTOR`, for its life; the server adds its secrets to it at start-up.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from urllib.parse import quote

FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s [%(session_id)s] %(message)s"
MASK = "***"
# Shorter configured values are not masked: replacing every occurrence of a 3-letter string would
# garble the log, and a key that short is guessed faster than it is read from a log.
MIN_SECRET_LEN = 6

# The word that ends a credential's field name (``token``, ``api_key``, ``twilio_auth_token``,
# ``Authorization``, ``credential``, SDP's ``ice-pwd``; not ``max_tokens``). Redaction runs on the
# event loop, for every line: each pattern starts with a literal, and is tried only on lines that
# hold one (``_TRIGGERS``).
_NAME_ENDS = ("token", "key", "secret", "password", "passwd", "pwd", "credential", "signature",
              "authorization", "cookie")
_NAME_END = "(?:" + "|".join(_NAME_ENDS) + ")"
_SHAPES = re.compile("|".join([
    # name=value, name: value, "name": "value", name='value'; an auth scheme stays readable.
    rf"(?P<field>{_NAME_END}\b[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic)\s+)?)[^\s\"'&;,)}}\]]+",
    r"(?P<subprotocol>openai-insecure-api-key\.)[^\s\"',\]]+",
    r"(?P<bearer>bearer\s+)[^\s\"',]+",
    # The password in a URL's user info: turn:user:PASSWORD@host, https://user:PASSWORD@host.
    r"(?P<userinfo>(?:://|\bturns?:)[^\s:@/]{0,128}:)[^\s@/]{1,256}(?=@)",
    r"(?P<ephemeral>)ek_[A-Za-z0-9_-]{8,}",
]), re.IGNORECASE)
# What every shape above contains: most lines contain none, and a substring test is far cheaper
# than the expression (Python's re has no fast scan for an alternation).
_TRIGGERS = (*_NAME_ENDS, "bearer", "://", "turn:", "turns:", "ek_")


def _keep_prefix(match: re.Match[str]) -> str:
    prefix = next(group for group in match.groups() if group is not None)
    return prefix + MASK


class Redactor:
    """Masks secrets in text: by shape (see the module doc) and the configured values.

    Values are counted: a session's own secrets (its MCP servers' headers) are added while it uses
    them and removed when it stops (:meth:`remove`), so that neither the set nor the work on every
    line grows with the sessions a process has served."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._secrets: tuple[str, ...] = ()

    def add(self, *secrets: str | None) -> None:
        """Mask these values (and their URL-encoded forms) from now on; None and short ones are
        skipped."""
        self._counts.update(self._forms(secrets))
        self._sort()

    def remove(self, *secrets: str | None) -> None:
        """Stop masking these values by value, once everyone who added them removed them."""
        self._counts.subtract(self._forms(secrets))
        self._counts = +self._counts  # drops what reached zero
        self._sort()

    @staticmethod
    def _forms(secrets: tuple[str | None, ...]) -> list[str]:
        return [form for secret in secrets if secret is not None and len(secret) >= MIN_SECRET_LEN
                for form in {secret, quote(secret, safe="")}]

    def _sort(self) -> None:
        # Longest first, so that a secret containing another is masked whole.
        self._secrets = tuple(sorted(self._counts, key=len, reverse=True))

    def __call__(self, text: str) -> str:
        lowered = text.lower()
        if any(trigger in lowered for trigger in _TRIGGERS):
            text = _SHAPES.sub(_keep_prefix, text)
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return text


REDACTOR = Redactor()


def hide_secrets(*secrets: str | None) -> None:
    """Mask these configured secrets on every log line of this process from now on."""
    REDACTOR.add(*secrets)


def unhide_secrets(*secrets: str | None) -> None:
    """The caller of :func:`hide_secrets` no longer holds these (a session's, when it ends)."""
    REDACTOR.remove(*secrets)


class RedactingFormatter(logging.Formatter):
    """The line as :class:`logging.Formatter` writes it (traceback included), then redacted."""

    def format(self, record: logging.LogRecord) -> str:
        return REDACTOR(super().format(record))


class _DefaultSession(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "session_id"):
            record.session_id = "-"
        return True


def setup_logging() -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_DefaultSession())
    handler.setFormatter(RedactingFormatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("DUPLEX_LOG_LEVEL", "INFO"))
