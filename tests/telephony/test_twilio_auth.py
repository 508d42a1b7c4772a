"""Who may use the Twilio endpoints, against a real ``duplex.serve`` (toy model) and real WebSocket
clients: with ``--api-key`` a Media Stream holds no session slot until its ``start`` carried the
key (sockets that never start cannot lock everyone out, and are closed after a deadline), and with
``--twilio-auth-token`` the voice webhook and the stream's handshake need Twilio's request
signature, computed here from Twilio's documented algorithm (checked on Twilio's own example)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx
import pytest
import websockets

from duplex.transports.twilio import MAX_START_CHARS, START_TIMEOUT_S
from harness.server import ServerProcess, run_server, write_preset

from .test_twilio import CONNECTED, start_message

pytestmark = pytest.mark.e2e

KEY = "sk-twilio-test-key"
AUTH_TOKEN = "twilio-auth-token-for-tests"
MAX_SESSIONS = 2
TIMEOUT = 30.0
STREAM = "/v1/telephony/twilio"
PROXY_HOST = "voice.example.com"
CALL = [("CallSid", "CA1234"), ("AccountSid", "AC5678"), ("From", "+15550001111"),
        ("To", "+15550002222"), ("CallStatus", "ringing")]


def twilio_signature(url: str, params: Sequence[tuple[str, str]] = (),
                     token: str = AUTH_TOKEN) -> str:
    """Twilio's documented algorithm: the URL, then each POST parameter's name and value in the
    order of their names; HMAC-SHA1 with the account's auth token; base64."""
    data = url + "".join(name + value for name, value in sorted(params))
    return base64.b64encode(hmac.new(token.encode(), data.encode(), hashlib.sha1).digest()).decode()


def test_the_signer_here_gives_twilios_own_example() -> None:
    params = [("CallSid", "CA1234567890ABCDE"), ("Caller", "+14158675309"), ("Digits", "1234"),
              ("From", "+14158675309"), ("To", "+18005551212")]
    assert twilio_signature("https://mycompany.com/myapp.php?foo=1&bar=2", params,
                            token="12345") == "RSOYDt4T1cUTdK1PDd93/VVr8B8="


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``--api-key`` and room for two sessions; no Twilio auth token."""
    tmp = tmp_path_factory.mktemp("twilio-keyed")
    with run_server(write_preset(tmp / "preset.yaml"), "--api-key", KEY,
                    "--max-sessions", str(MAX_SESSIONS), tmp=tmp) as running:
        yield running


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``--twilio-auth-token``, reachable through a proxy as ``PROXY_HOST``; no API key."""
    tmp = tmp_path_factory.mktemp("twilio-signed")
    with run_server(write_preset(tmp / "preset.yaml"), "--twilio-auth-token", AUTH_TOKEN,
                    "--allowed-host", PROXY_HOST, tmp=tmp) as running:
        yield running


def stream_url(server: ServerProcess, query: str = "") -> str:
    return server.url.replace("http://", "ws://") + STREAM + query


def twilio_metric(server: ServerProcess, name: str) -> float:
    """A sample of /metrics for the twilio transport (the key is ignored where none is set)."""
    return server.metric(name, {"transport": "twilio"}, headers={"Authorization": f"Bearer {KEY}"})


async def closed(ws: websockets.ClientConnection, timeout: float = TIMEOUT) -> tuple[int, str]:
    """The close code and reason the server sends; whatever came before is skipped."""
    with pytest.raises(websockets.ConnectionClosed) as err:
        async with asyncio.timeout(timeout):
            while True:
                await ws.recv()
    assert err.value.rcvd is not None, "closed without a close frame from the server"
    return err.value.rcvd.code, err.value.rcvd.reason


async def until_metric(server: ServerProcess, name: str, value: float) -> None:
    async with asyncio.timeout(TIMEOUT):
        while twilio_metric(server, name) != value:
            await asyncio.sleep(0.1)  # the gauge lives in another process: polled


@contextlib.asynccontextmanager
async def stream(url: str, parameters: dict[str, str] | None = None,
                 **connect: Any) -> AsyncIterator[websockets.ClientConnection]:
    """A Twilio stream to ``url`` that has sent ``connected`` and ``start`` with these custom
    parameters; ``stop`` when done. ``connect``: more arguments of ``websockets.connect``."""
    async with websockets.connect(url, **connect) as ws:
        await ws.send(CONNECTED)
        await ws.send(start_message("MZ1", **(parameters or {})))
        yield ws
        with contextlib.suppress(websockets.ConnectionClosed):
            await ws.send(json.dumps({"event": "stop", "streamSid": "MZ1"}))


# --- --api-key: no slot before `start` carried the key -------------------------------------------


async def test_streams_that_never_start_hold_no_slot_and_are_closed(keyed: ServerProcess) -> None:
    async with contextlib.AsyncExitStack() as stack:
        idle = [await stack.enter_async_context(websockets.connect(stream_url(keyed)))
                for _ in range(MAX_SESSIONS)]
        await idle[0].send(CONNECTED)  # Twilio's first message is allowed; the other says nothing
        # As many sockets as there are slots, and still an authenticated client gets a session.
        realtime = keyed.url.replace("http://", "ws://") + "/v1/realtime?model=any"
        async with websockets.connect(realtime, additional_headers={
                "Authorization": f"Bearer {KEY}"}) as client:
            first = json.loads(await asyncio.wait_for(client.recv(), TIMEOUT))
            assert first["type"] == "session.created", first
        async with stream(stream_url(keyed), {"token": KEY}):
            await until_metric(keyed, "duplex_sessions_active", 1)
        # Nothing started: each idle socket is closed for it once the deadline has passed.
        for ws in idle:
            code, reason = await closed(ws, START_TIMEOUT_S + TIMEOUT)
            assert code == 1008 and "no 'start' within" in reason
    await until_metric(keyed, "duplex_sessions_active", 0)


async def test_a_wrong_token_is_refused_without_taking_a_slot(keyed: ServerProcess) -> None:
    admitted = twilio_metric(keyed, "duplex_sessions_total")
    for query, parameters in [("", {"token": "sk-wrong"}), ("?token=sk-wrong", {}), ("", {})]:
        async with stream(stream_url(keyed, query), parameters) as ws:
            assert await closed(ws) == (1008, "missing or invalid token")
    assert twilio_metric(keyed, "duplex_sessions_active") == 0
    assert twilio_metric(keyed, "duplex_sessions_total") == admitted


async def test_before_start_only_one_small_connected_is_allowed(keyed: ServerProcess) -> None:
    admitted = twilio_metric(keyed, "duplex_sessions_total")
    media = json.dumps({"event": "media", "media": {"payload": ""}})
    large = json.dumps({"event": "connected", "protocol": "x" * MAX_START_CHARS})
    for before, why in [([CONNECTED, CONNECTED], "'connected' before 'start'"),
                        ([media], "'media' before 'start'"), ([large], "characters")]:
        async with websockets.connect(stream_url(keyed, f"?token={KEY}")) as ws:
            for message in before:
                await ws.send(message)
            code, reason = await closed(ws)
            assert code == 1008 and why in reason
    assert twilio_metric(keyed, "duplex_sessions_total") == admitted


async def test_the_session_limit_applies_at_start(keyed: ServerProcess) -> None:
    # The key in the stream's query, then as the TwiML's custom parameter: both authenticate.
    async with (stream(stream_url(keyed, f"?token={KEY}")),
                stream(stream_url(keyed), {"token": KEY})):
        await until_metric(keyed, "duplex_sessions_active", MAX_SESSIONS)
        async with stream(stream_url(keyed), {"token": KEY}) as third:
            code, reason = await closed(third)
        assert code == 1013 and "limit" in reason
    await until_metric(keyed, "duplex_sessions_active", 0)


async def test_without_an_auth_token_an_unsigned_webhook_is_answered(keyed: ServerProcess) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{keyed.url}{STREAM}/voice?token={KEY}", data=dict(CALL))
        refused = await http.post(f"{keyed.url}{STREAM}/voice", data=dict(CALL))
    assert response.status_code == 200 and "<Stream url=" in response.text
    assert refused.status_code == 401


def test_the_log_holds_no_secret(keyed: ServerProcess) -> None:
    assert KEY not in keyed.log()


# --- --twilio-auth-token: Twilio's signature on the webhook and the stream -----------------------


PROXIED = {"Host": PROXY_HOST, "X-Forwarded-Proto": "https"}
PUBLIC = f"https://{PROXY_HOST}{STREAM}/voice"


@pytest.mark.parametrize(("headers", "signed_url", "body", "token", "status"), [
    pytest.param({}, "{local}", CALL, AUTH_TOKEN, 200, id="signed"),
    pytest.param({}, "{local}", CALL, None, 403, id="missing"),
    pytest.param({}, "{local}", CALL, "another-token", 403, id="another-token"),
    pytest.param({}, "{local}", [*CALL[:-1], ("CallStatus", "completed")], AUTH_TOKEN, 403,
                 id="body-changed"),
    pytest.param({}, "{local}?x=1", CALL, AUTH_TOKEN, 403, id="another-url"),
    pytest.param(PROXIED, PUBLIC, CALL, AUTH_TOKEN, 200, id="behind-a-proxy"),
    pytest.param(PROXIED, PUBLIC.replace(PROXY_HOST, f"{PROXY_HOST}:443"), CALL, AUTH_TOKEN, 200,
                 id="default-port-added"),
    pytest.param({**PROXIED, "Host": f"{PROXY_HOST}:8443"}, PUBLIC, CALL, AUTH_TOKEN, 200,
                 id="port-removed"),
    pytest.param(PROXIED, PUBLIC.replace("https:", "http:"), CALL, AUTH_TOKEN, 403,
                 id="another-scheme"),
])
async def test_the_voice_webhook_needs_twilios_signature(
        signed: ServerProcess, headers: dict[str, str], signed_url: str,
        body: list[tuple[str, str]], token: str | None, status: int) -> None:
    """Twilio signed ``signed_url`` with the ``CALL`` parameters; the server gets ``body``."""
    sent = dict(headers)
    if token is not None:
        url = signed_url.format(local=f"{signed.url}{STREAM}/voice")
        sent["X-Twilio-Signature"] = twilio_signature(url, CALL, token)
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{signed.url}{STREAM}/voice", data=dict(body), headers=sent)
    assert response.status_code == status, response.text
    if status == 403:
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_signature"
    else:
        origin = f"wss://{headers['Host']}" if headers else signed.url.replace("http://", "ws://")
        assert f'<Stream url="{origin}{STREAM}">' in response.text


async def test_the_stream_needs_twilios_signature(signed: ServerProcess) -> None:
    admitted = twilio_metric(signed, "duplex_sessions_total")
    url = stream_url(signed)
    for signature in (None, twilio_signature(url, token="other"), twilio_signature(url + "?x=1")):
        headers = {"X-Twilio-Signature": signature} if signature else None
        async with websockets.connect(url, additional_headers=headers) as ws:  # refused at once
            code, reason = await closed(ws)
            assert code == 1008 and "X-Twilio-Signature" in reason
    assert twilio_metric(signed, "duplex_sessions_total") == admitted
    async with stream(url, additional_headers={"X-Twilio-Signature": twilio_signature(url)}):
        await until_metric(signed, "duplex_sessions_active", 1)
    # Behind a proxy Twilio signed the public wss:// URL (the client here names the proxy's host
    # in its request but connects to the server's port: the proxy's part).
    public = f"wss://{PROXY_HOST}{STREAM}"
    through_proxy = {"host": "127.0.0.1", "port": httpx.URL(signed.url).port}
    async with stream(public.replace("wss:", "ws:"), **through_proxy, additional_headers={
            "X-Forwarded-Proto": "https", "X-Twilio-Signature": twilio_signature(public)}):
        await until_metric(signed, "duplex_sessions_total", admitted + 2)
    await until_metric(signed, "duplex_sessions_active", 0)


def test_the_log_holds_no_auth_token(signed: ServerProcess) -> None:
    assert AUTH_TOKEN not in signed.log()
