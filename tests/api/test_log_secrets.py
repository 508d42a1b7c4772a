"""No secret reaches the server's output (DESIGN.md, invariant 10): a real server at DEBUG, with an
API key, a Twilio auth token and a TURN server with a password, is called on every endpoint with
the key in every form a client sends it (Bearer header, ``?token=``, the browser subprotocol, an
ephemeral client secret); then nothing the process wrote, stdout and stderr, holds any of them.
The redaction's shapes are checked on their own too, on values the server was never told."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from aiortc import RTCSessionDescription
from websockets.asyncio.client import connect

from duplex.api.twilio_signature import signature
from duplex.logs import MASK, Redactor
from harness.mic import ScriptedMic
from harness.peers import ClientPeer
from harness.server import ServerProcess, run_server, write_preset
from tests.api.helpers import PIPELINE, SHORT_ANSWER, TIMEOUT

KEY = "sk-logtest-0c1d2e3f4a5b"
TWILIO_TOKEN = "twtok-9e8d7c6b5a41"
TURN_PASSWORD = "turnpw-5b3c19d7e2"
TURN = f"turn:alice:{TURN_PASSWORD}@127.0.0.1:3478?transport=udp"
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("log_secrets")
    preset = write_preset(tmp / "preset.yaml", pipeline=PIPELINE, api_key=KEY,
                          twilio_auth_token=TWILIO_TOKEN, max_sessions=3)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DUPLEX_LOG_LEVEL", "DEBUG")
        with run_server(preset, "--ice-server", TURN, tmp=tmp) as running:
            yield running


def ws_base(server: ServerProcess) -> str:
    return server.url.replace("http://", "ws://")


async def realtime_session(server: ServerProcess, headers: dict[str, str] | None = None,
                           subprotocols: list[str] | None = None) -> None:
    """Open a Realtime session with these credentials and leave once it is created."""
    async with connect(f"{ws_base(server)}/v1/realtime?model=gpt-realtime", additional_headers=headers,
                       subprotocols=subprotocols) as ws:  # type: ignore[arg-type]
        assert json.loads(await ws.recv())["type"] == "session.created"


async def webrtc_call(server: ServerProcess, http: httpx.AsyncClient, secret: str) -> None:
    """A real WebRTC call opened with ``secret`` (aiortc and aioice log at DEBUG), then hung up."""
    peer = ClientPeer(ScriptedMic())
    try:
        answer = await http.post(f"{server.url}/v1/realtime/calls", content=await peer.offer(),
                                 headers={"Content-Type": "application/sdp",
                                          "Authorization": f"Bearer {secret}"})
        assert answer.status_code == 201, answer.text
        await peer.pc.setRemoteDescription(
            RTCSessionDescription(peer.policy.filter_candidates(answer.text), "answer"))
        peer.channel.on("open", peer.notify)
        await peer.wait_for(lambda: peer.channel.readyState == "open", TIMEOUT)
        hangup = await http.post(f"{server.url}{answer.headers['location']}/hangup", headers=BEARER)
        assert hangup.status_code == 200
    finally:
        await peer.close()


async def twilio_calls(server: ServerProcess, http: httpx.AsyncClient) -> None:
    """The voice webhook and the media stream, signed as Twilio signs them, key in the query."""
    voice = f"{server.url}/v1/telephony/twilio/voice?token={KEY}"
    form = {"CallSid": "CA0001", "From": "+15550001"}
    answer = await http.post(voice, data=form, headers={
        "X-Twilio-Signature": signature(TWILIO_TOKEN, voice, form.items())})
    assert answer.status_code == 200, answer.text
    stream = f"{ws_base(server)}/v1/telephony/twilio?token={KEY}"
    async with connect(stream, additional_headers={
            "X-Twilio-Signature": signature(TWILIO_TOKEN, stream)}) as ws:
        await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await ws.send(json.dumps({"event": "start", "streamSid": "MZ01", "start": {
            "streamSid": "MZ01", "callSid": "CA0001", "customParameters": {"token": KEY},
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}))
        await ws.send(json.dumps({"event": "stop", "streamSid": "MZ01"}))
        await ws.wait_closed()


async def test_no_secret_in_the_servers_output(server: ServerProcess) -> None:
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        minted = await http.post(f"{server.url}/v1/realtime/client_secrets", headers=BEARER, json={})
        assert minted.status_code == 200, minted.text
        ephemeral = minted.json()["value"]
        ephemeral_bearer = {"Authorization": f"Bearer {ephemeral}"}
        chat = await http.post(f"{server.url}/v1/chat/completions", headers=BEARER, json={
            "model": "m", "max_completion_tokens": SHORT_ANSWER,
            "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        for path, headers in [("/v1/models", BEARER), ("/metrics", BEARER),
                              ("/v1/realtime/ice_servers", ephemeral_bearer)]:
            assert (await http.get(f"{server.url}{path}", headers=headers)).status_code == 200, path
        await realtime_session(server, headers=BEARER)
        await realtime_session(server, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"])
        await realtime_session(server, headers=ephemeral_bearer)
        await realtime_session(server, subprotocols=["realtime", f"openai-insecure-api-key.{ephemeral}"])
        await webrtc_call(server, http, ephemeral)
        await twilio_calls(server, http)

    output = server.log()
    leaks = [line for line in output.splitlines()
             if any(form in line for secret in (KEY, TWILIO_TOKEN, TURN_PASSWORD, ephemeral)
                    for form in (secret, quote(secret, safe=""), secret[:10]))]
    assert not leaks, "secrets in the server's output:\n" + "\n".join(leaks[:20])
    # Not vacuous: the lines that used to carry the key are there, redacted.
    assert " DEBUG " in output
    assert f"/v1/telephony/twilio/voice?token={MASK}" in output
    # aiortc logs whole SDPs at DEBUG: the calls' ICE passwords go too.
    assert "a=ice-pwd:" in output and not re.search(r"ice-pwd:(?!\*\*\*)", output)


@pytest.mark.parametrize("line, secret", [
    ('1.2.3.4:5 - "POST /v1/telephony/twilio/voice?a=1&token=guess-1234&b=2 HTTP/1.1" 401', "guess-1234"),
    ("< Authorization: Bearer not-our-key", "not-our-key"),
    ("< authorization: bare-key-value", "bare-key-value"),
    ("< Sec-WebSocket-Protocol: realtime, openai-insecure-api-key.wrong-key", "wrong-key"),
    ("""< TEXT '{"event":"start","start":{"customParameters":{"token":"sk-trunc...' [99 bytes]""", "sk-trunc"),
    ("ServerSettings(preset='toy', api_key='sk-in-a-repr', max_sessions=8)", "sk-in-a-repr"),
    ("RTCIceServer(urls='turn:relay:3478', username='bob', credential='s3cret-pw')", "s3cret-pw"),
    ("bad ICE server 'turn:bob:hunter22@relay:3478'", "hunter22"),
    ("refused ek_AbCdEfGhIjKlMnOpQrStUvWx", "ek_AbCdEfGhIjKlMnOpQrStUvWx"),
    ("a=ice-ufrag:PMiz\na=ice-pwd:IcSm3Gt1oW7koENUTAUv7c", "IcSm3Gt1oW7koENUTAUv7c"),
])
def test_secrets_are_masked_by_shape(line: str, secret: str) -> None:
    """Values the redactor was never given (a client's wrong key, another server's secret)."""
    masked = Redactor()(line)
    assert secret not in masked and MASK in masked


def test_configured_secrets_are_masked_anywhere_and_the_rest_is_kept() -> None:
    redactor = Redactor()
    redactor.add("Pa$$ word/42", None, "short")
    line = "max_tokens=60 session sess_1 said Pa$$ word/42, then Pa%24%24%20word%2F42, short"
    assert redactor(line) == f"max_tokens=60 session sess_1 said {MASK}, then {MASK}, short"


def test_a_secret_added_twice_is_masked_until_both_holders_removed_it() -> None:
    """Sessions add their own secrets and remove them when they end: the redactor then forgets
    them (its work on every line does not grow with the sessions served), but not while another
    holder of the same value still uses it."""
    redactor = Redactor()
    redactor.add("per-session-header-1", "per-session-header-1")
    redactor.remove("per-session-header-1")
    assert redactor("sent per-session-header-1") == f"sent {MASK}"
    redactor.remove("per-session-header-1")
    assert redactor("sent per-session-header-1") == "sent per-session-header-1"
    redactor.remove("never-added-value")  # a remove without an add changes nothing
    assert redactor("sent never-added-value") == "sent never-added-value"
