"""Sessions a client may resume after its connection dropped: one server's resume tokens and the
grace periods of the sessions that wait for their client (docs/resume.md).

A resumable session is enrolled once, with the credential its client authenticated with (the API
key or an ephemeral client secret; None where the server has no key), and holds at most one live
token at a time: ``issue`` gives it a new one (its ``session.created`` carries it) and the previous
one dies. ``take`` is a resume: it checks the token and the credential, uses the token up (single
use: the resumed session's new ``session.created`` carries the next one) and stops the grace
period. A token is good while its session is live and, once its connection dropped
(``detached``), until the grace period ends; then the session is ended for good (``expire``).

Nothing is kept in clear: the store holds the SHA-256 HMAC of each token and of each credential,
keyed with a random salt of this server, and compares digests in constant time.

One ResumeStore per app (``AppState.resumes``), for the server's life: a restart forgets every token. An
entry lives from ``enrol`` until its session ends (``forget``) or its grace period ends; the
store holds the grace timers and the expiry tasks, nothing else of a session.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

TOKEN_PREFIX = "rsm_"


class Resumable(Protocol):
    """A session a client may resume (the transport's connection object owns it)."""

    id: str

    async def expire(self) -> None:
        """The grace period ended without a resume: end the session for good."""


class ResumeRefused(Exception):
    """The token is unknown, used up, expired, or was issued to another credential. The message
    is for the server's log; the client hears only that its token was refused."""


@dataclass
class _Entry:
    holder: Resumable
    credential: bytes  # HMAC of the credential its client authenticated with
    token: bytes | None = None  # HMAC of its live token (None: used up, not yet issued again)
    timer: asyncio.TimerHandle | None = None  # the grace period, while it has no connection


class ResumeStore:
    """See the module doc. ``grace_s`` 0 turns resumption off (``enabled``)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._salt = secrets.token_bytes(32)
        self._by_session: dict[str, _Entry] = {}
        self._by_token: dict[bytes, _Entry] = {}
        self._expiring: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0

    def __len__(self) -> int:
        return len(self._by_session)

    def _digest(self, secret: str | None) -> bytes:
        return hmac.new(self._salt, (secret or "").encode(), hashlib.sha256).digest()

    def enrol(self, holder: Resumable, credential: str | None) -> None:
        """``holder`` may be resumed by a client that authenticates with ``credential``."""
        self._by_session[holder.id] = _Entry(holder, self._digest(credential))

    def issue(self, holder: Resumable) -> str | None:
        """A new token for ``holder`` (its previous one dies); None where it is not enrolled."""
        entry = self._by_session.get(holder.id)
        if entry is None:
            return None
        self._drop_token(entry)
        token = f"{TOKEN_PREFIX}{secrets.token_urlsafe(32)}"
        entry.token = self._digest(token)
        self._by_token[entry.token] = entry
        return token

    def detached(self, holder: Resumable) -> None:
        """``holder``'s connection dropped: it is ended unless resumed within the grace period. A
        holder whose token was just taken (a resume under way) has no grace period to wait."""
        entry = self._by_session.get(holder.id)
        if entry is None or entry.token is None:
            return
        self._stop_timer(entry)
        entry.timer = asyncio.get_running_loop().call_later(self.grace_s, self._expire, entry)

    def take(self, token: str, credential: str | None) -> Resumable:
        """The session ``token`` resumes, its token used up; raises ResumeRefused."""
        entry = self._by_token.get(self._digest(token)) if token.startswith(TOKEN_PREFIX) else None
        if entry is None or entry.token is None:
            raise ResumeRefused("unknown, used or expired resume token")
        if not hmac.compare_digest(entry.credential, self._digest(credential)):
            raise ResumeRefused(f"resume token of session {entry.holder.id} presented with "
                                "another credential than the one it was issued to")
        self._drop_token(entry)
        self._stop_timer(entry)
        return entry.holder

    def forget(self, holder: Resumable) -> None:
        """``holder``'s session ended for good: its token and grace period go."""
        entry = self._by_session.pop(holder.id, None)
        if entry is not None:
            self._drop_token(entry)
            self._stop_timer(entry)

    def _expire(self, entry: _Entry) -> None:
        entry.timer = None
        if self._by_session.get(entry.holder.id) is not entry:
            return
        log.info("no resume of session %s within %g s: it ends", entry.holder.id, self.grace_s,
                 extra={"session_id": entry.holder.id})
        self.forget(entry.holder)
        task = asyncio.get_running_loop().create_task(entry.holder.expire())
        self._expiring.add(task)
        task.add_done_callback(self._expiring.discard)

    def _drop_token(self, entry: _Entry) -> None:
        if entry.token is not None:
            self._by_token.pop(entry.token, None)
            entry.token = None

    @staticmethod
    def _stop_timer(entry: _Entry) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

