"""The call webhook's signature and delivery (duplex/transports/sip/webhook.py) on their own: the
Standard Webhooks test vector, the ``openai`` package's verifier, and deliveries that fail."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest
from aiohttp import web

from duplex.settings import load_preset
from duplex.transports.sip.webhook import (
    CallWebhook,
    WebhookFailed,
    incoming_call_event,
    signature,
    signing_key,
)
from pipeline.config import ConfigError

VERIFIER = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1").webhooks


def test_the_standard_webhooks_test_vector() -> None:
    """The example of the Standard Webhooks specification (and svix's libraries' tests)."""
    key = signing_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    assert signature(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330,
                     b'{"test": 2432232314}') == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_a_plain_secret_is_its_own_key_and_a_bad_whsec_is_refused() -> None:
    assert signing_key("plain secret") == b"plain secret"
    with pytest.raises(ValueError, match="base64"):
        signing_key("whsec_not*base64")


def test_the_event_leaves_credentials_out() -> None:
    event = incoming_call_event("sip_1", [("From", "<sip:a@b>"), ("Authorization", "Digest x"),
                                          ("Proxy-Authorization", "Digest y"), ("X-Id", "7")])
    assert event["data"]["sip_headers"] == [{"name": "From", "value": "<sip:a@b>"},
                                            {"name": "X-Id", "value": "7"}]


async def _receiver(status: int, seen: list[tuple[dict[str, str], bytes]]) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.Response:
        seen.append(({k.lower(): v for k, v in request.headers.items()}, await request.read()))
        return web.Response(status=status)

    app = web.Application()
    app.router.add_post("/hook", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/hook"


@pytest.mark.parametrize("secret", ["whsec_c2VjcmV0IGJ5dGVzIG9mIHRoZSB0ZXN0", "a plain secret"])
async def test_a_delivery_verifies_with_the_openai_package(secret: str) -> None:
    seen: list[tuple[dict[str, str], bytes]] = []
    runner, url = await _receiver(204, seen)
    webhook = CallWebhook(url, secret, 5.0)
    try:
        await webhook.deliver(incoming_call_event("sip_x", [("Call-ID", "x")]))
    finally:
        await webhook.close()
        await runner.cleanup()
    [(headers, body)] = seen
    assert headers["content-type"] == "application/json"
    VERIFIER.verify_signature(body, headers, secret=secret)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        VERIFIER.verify_signature(body.replace(b"sip_x", b"sip_y"), headers, secret=secret)


async def test_a_non_2xx_answer_or_no_listener_fails_the_delivery() -> None:
    runner, url = await _receiver(500, [])
    webhook = CallWebhook(url, "s", 5.0)
    try:
        with pytest.raises(WebhookFailed, match="500"):
            await webhook.deliver(incoming_call_event("sip_x", []))
    finally:
        await webhook.close()
        await runner.cleanup()
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    webhook = CallWebhook(f"http://127.0.0.1:{closed}/hook", "s", 5.0)
    try:
        with pytest.raises(WebhookFailed, match="ConnectError"):
            await asyncio.wait_for(webhook.deliver(incoming_call_event("sip_x", [])), 10)
    finally:
        await webhook.close()


def test_a_webhook_needs_its_secret() -> None:
    with pytest.raises(ConfigError, match="call_webhook_secret"):
        load_preset(["--preset", "toy", "--call-webhook", "http://127.0.0.1:9/hook"], environ={})
    settings = load_preset(["--preset", "toy"], environ={
        "DUPLEX_CALL_WEBHOOK": "https://app.example/hook", "DUPLEX_CALL_WEBHOOK_SECRET": "s",
        "DUPLEX_CALL_DECISION_TIMEOUT_S": "4"}).settings
    assert (settings.call_webhook, settings.call_decision_timeout_s) == ("https://app.example/hook", 4.0)
    assert "call_webhook_secret" not in repr(settings)  # never printed with the settings
