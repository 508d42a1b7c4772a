"""The live ephemeral client secrets of one server (``ek_...``, minted by
``POST /v1/realtime/client_secrets``), in memory, each until it expires; expired ones are dropped
whenever secrets are minted or checked. One :class:`ClientSecrets` per app (``app.state``), for the
server's life: a restart forgets them all."""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from duplex.protocol.session_update import apply_session_update

MAX_SECRETS = 10_000  # beyond, the oldest go first: a client minting in a loop bounds its own cost


@dataclass(frozen=True)
class ClientSecret:
    value: str = field(repr=False)  # a credential: never in a log line through a repr
    expires_at: float
    session: dict[str, Any] | None  # the session.update to open sessions with (validated)


class ClientSecrets:
    """The live secrets of one server; see the module doc."""

    def __init__(self) -> None:
        self._live: dict[str, ClientSecret] = {}

    def mint(self, ttl_s: int, session: dict[str, Any] | None) -> ClientSecret:
        self._prune()
        while len(self._live) >= MAX_SECRETS:
            del self._live[next(iter(self._live))]
        secret = ClientSecret(f"ek_{secrets.token_urlsafe(24)}", time.time() + ttl_s, session)
        self._live[secret.value] = secret
        return secret

    def check(self, given: str | None) -> ClientSecret | None:
        """The live secret ``given`` is, or None (compared in constant time)."""
        if not given or not given.startswith("ek_"):
            return None
        self._prune()
        found = self._live.get(given)
        return found if found is not None and hmac.compare_digest(found.value, given) else None

    def _prune(self) -> None:
        now = time.time()
        for value in [v for v, s in self._live.items() if s.expires_at <= now]:
            del self._live[value]


def client_secrets(state_holder: Any) -> ClientSecrets:
    """The server's store, made on first use (``state_holder`` is ``app.state``)."""
    store = getattr(state_holder, "client_secrets", None)
    if store is None:
        store = state_holder.client_secrets = ClientSecrets()
    return store


def apply_secret_session(session: Any, update: dict[str, Any]) -> None:
    """Open ``session`` (a new :class:`~duplex.session.session.Session`) with the configuration
    its secret was minted with (validated then, so nothing is refused now)."""
    voices = [*session.voices, *session.defaults.voice_map]
    config, _ = apply_session_update(session.config, update, voices, session.defaults.mcp_servers)
    session.reconfigure(config)
