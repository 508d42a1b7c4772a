"""The incoming-call webhook (``--call-webhook``): one signed ``realtime.call.incoming`` POST per
call, in the shape and with the signature of OpenAI's webhooks.

Signing follows Standard Webhooks, as OpenAI's webhooks do (and as the ``openai`` package's
``client.webhooks.unwrap`` / ``verify_signature`` check it): three headers,

- ``webhook-id``: unique per delivery (``wh_`` and 32 hex digits; the body's ``id`` is the event's);
- ``webhook-timestamp``: when it was sent, in Unix seconds;
- ``webhook-signature``: ``v1,`` and the base64 HMAC-SHA256 of ``"{id}.{timestamp}.{body}"``.

The HMAC key is the secret's UTF-8 bytes, or, for a secret written ``whsec_<base64>`` (OpenAI's
form), the bytes that base64 stands for. A receiver recomputes the HMAC over the body it received,
compares in constant time and refuses old timestamps (a replay).

A :class:`CallWebhook` lives as long as the server and holds one HTTP client; each delivery belongs
to the call that rings and is cancelled with it. There are no retries: a caller is waiting.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Iterable
from typing import Any

import httpx

log = logging.getLogger(__name__)

EVENT_TYPE = "realtime.call.incoming"
# Credentials of the caller's INVITE never leave the server (OpenAI leaves them out too).
PRIVATE_HEADERS = frozenset({"authorization", "proxy-authorization"})


class WebhookFailed(Exception):
    """The app did not take the webhook: no connection, a non-2xx answer, or an error on the way."""


def signing_key(secret: str) -> bytes:
    """The HMAC key of ``secret`` (see module doc); ValueError for a ``whsec_`` secret whose rest
    is not base64."""
    if secret.startswith("whsec_"):
        try:
            return base64.b64decode(secret[len("whsec_"):], validate=True)
        except binascii.Error:
            raise ValueError("a webhook secret that begins with whsec_ must go on in base64") from None
    return secret.encode()


def signature(key: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value of one delivery."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def incoming_call_event(call_id: str, headers: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """The webhook's body: OpenAI's ``realtime.call.incoming`` event for one ringing call."""
    return {
        "object": "event",
        "id": f"evt_{secrets.token_hex(12)}",
        "type": EVENT_TYPE,
        "created_at": int(time.time()),
        "data": {
            "call_id": call_id,
            "sip_headers": [{"name": name, "value": value} for name, value in headers
                            if name.lower() not in PRIVATE_HEADERS],
        },
    }


class CallWebhook:
    """POSTs signed events to the operator's URL (module doc)."""

    def __init__(self, url: str, secret: str, timeout_s: float) -> None:
        self.url = url
        self._key = signing_key(secret)
        self._client = httpx.AsyncClient(timeout=timeout_s, follow_redirects=False,
                                         headers={"user-agent": "duplex (call webhook)"})

    async def deliver(self, event: dict[str, Any]) -> None:
        """POST ``event`` once; returns when the app answered 2xx, raises :class:`WebhookFailed`."""
        body = json.dumps(event, separators=(",", ":")).encode()
        webhook_id = f"wh_{secrets.token_hex(16)}"
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": webhook_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(self._key, webhook_id, timestamp, body),
        }
        try:
            answer = await self._client.post(self.url, content=body, headers=headers)
        except httpx.HTTPError as err:
            raise WebhookFailed(f"{type(err).__name__}: {err}") from None
        if not answer.is_success:
            raise WebhookFailed(f"the webhook answered {answer.status_code}")

    async def close(self) -> None:
        await self._client.aclose()
