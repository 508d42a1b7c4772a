"""``GET /v1/models`` and ephemeral client secrets (``POST /v1/realtime/client_secrets``) through
the real ``openai`` SDK, against a real server (toy preset, with an API key)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, AuthenticationError

from duplex.api import ephemeral_keys
from duplex.app import create_app
from duplex.settings import load_preset
from duplex.transports.webrtc.ice import IcePolicy
from harness.server import ServerProcess, write_preset
from tests.api.helpers import API_KEY, AUTH, realtime


async def test_models_lists_the_presets_model(server: ServerProcess) -> None:
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    models = [m async for m in client.models.list()]
    assert [m.id for m in models] == ["toy"]
    assert models[0].object == "model" and models[0].created > 0
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{server.url}/v1/models")).status_code == 401


async def test_a_client_secret_opens_a_session_like_the_key(server: ServerProcess) -> None:
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    minted = await client.realtime.client_secrets.create(
        expires_after={"anchor": "created_at", "seconds": 60},
        session={"type": "realtime", "instructions": "Speak like a pirate.",
                 "audio": {"output": {"voice": "marin"}}})
    assert minted.value.startswith("ek_")
    assert minted.session.instructions == "Speak like a pirate."
    async with realtime(server, api_key=minted.value) as rt:
        created = await rt.wait("session.created")
    # The session opened with the secret's configuration.
    assert created.session.instructions == "Speak like a pirate."
    assert created.session.audio.output.voice == "marin"
    # HTTP endpoints take it like the key; minting takes the key itself.
    headers = {"Authorization": f"Bearer {minted.value}"}
    async with httpx.AsyncClient(headers=headers) as http:
        assert (await http.get(f"{server.url}/v1/models")).status_code == 200
        assert (await http.post(f"{server.url}/v1/realtime/client_secrets", json={})).status_code == 401
    # A made-up secret is refused like a wrong key: closed with 1008 before any event.
    async with realtime(server, api_key="ek_made_up") as refused:
        await refused.wait_for(lambda: refused.ended)
    assert refused.closed is not None and refused.closed.rcvd.code == 1008 and not refused.events


@pytest.mark.parametrize(("body", "param"), [
    ({"expires_after": {"anchor": "created_at", "seconds": 5}}, "expires_after.seconds"),
    ({"session": {"type": "realtime", "audio": {"output": {"voice": "nobody"}}}}, "session.audio.output.voice"),
])
def test_bad_secret_requests_name_the_parameter(server: ServerProcess, body: dict, param: str) -> None:
    response = httpx.post(f"{server.url}/v1/realtime/client_secrets", headers=AUTH, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


async def test_without_the_key_the_sdk_cannot_mint(server: ServerProcess) -> None:
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong")
    with pytest.raises(AuthenticationError):
        await client.realtime.client_secrets.create(session={"type": "realtime"})


def test_secrets_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    store = ephemeral_keys.ClientSecrets()
    secret = store.mint(60, None)
    assert store.check(secret.value) is secret
    assert store.check(secret.value + "x") is None
    now = ephemeral_keys.time.time()
    monkeypatch.setattr(ephemeral_keys.time, "time", lambda: now + 61)
    assert store.check(secret.value) is None


async def test_calls_take_a_client_secret_like_the_key(tmp_path: Path) -> None:
    """In process, the pipeline not loaded: past the key check a call gets 503, not 401."""
    preset = load_preset(["--config", str(write_preset(tmp_path / "p.yaml", api_key=API_KEY))], environ={})
    app = create_app(preset, IcePolicy(hosts=("127.0.0.1",)))
    sdp = {"Content-Type": "application/sdp"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://duplex") as http:
        minted = await http.post("/v1/realtime/client_secrets", headers=AUTH, json={})
        secret = minted.json()["value"]
        made_up = {**sdp, "Authorization": "Bearer ek_made_up"}
        assert (await http.post("/v1/realtime/calls", content="v=0", headers=made_up)).status_code == 401
        keyed = {**sdp, "Authorization": f"Bearer {secret}"}
        assert (await http.post("/v1/realtime/calls", content="v=0", headers=keyed)).status_code == 503
