"""Admission of WebRTC calls: ``--max-sessions`` refuses with 503 + Retry-After, a hang-up frees the
slot, and the server's shutdown ends every call. The app runs in this process (httpx's ASGI
transport) with the toy pipeline in-process; the client offers are real aiortc offers."""

from __future__ import annotations

import asyncio
import json
import gc
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from aiortc import RTCSessionDescription

from duplex.app_state import AppState
from duplex.app import create_app
from duplex.settings import load_preset
from duplex.transports.webrtc.ice import IcePolicy, parse_ice_server
from harness.mic import ScriptedMic
from harness.peers import ClientPeer
from harness.server import write_preset
from harness.speech import speech
from pipeline.runner import start_pipeline


@pytest.fixture(scope="module")
async def app_state(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[httpx.AsyncClient, AppState]]:
    path = write_preset(tmp_path_factory.mktemp("limits") / "preset.yaml", max_sessions=1)
    preset = load_preset(["--config", str(path)], environ={})
    app = create_app(preset, IcePolicy(hosts=("127.0.0.1",)))
    state: AppState = app.state.duplex
    state.pipeline = await start_pipeline(preset.pipeline, mode="inproc")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        yield http, state
    await state.registry.close_all()
    await state.pipeline.close()


async def offer(http: httpx.AsyncClient) -> tuple[ClientPeer, httpx.Response]:
    peer = ClientPeer(ScriptedMic())
    response = await http.post("/v1/realtime/calls", content=await peer.offer(),
                               headers={"Content-Type": "application/sdp"})
    return peer, response


async def test_max_sessions_refuses_then_frees_on_hangup(app_state: tuple[httpx.AsyncClient, AppState]) -> None:
    http, state = app_state
    first_peer, first = await offer(http)
    assert first.status_code == 201
    second_peer, second = await offer(http)
    assert second.status_code == 503
    assert second.headers["retry-after"].isdigit()
    assert second.json()["error"]["code"] == "too_many_sessions"
    assert len(state.registry) == 1
    assert (await http.post(f"{first.headers['location']}/hangup")).status_code == 200
    assert len(state.registry) == 0
    third_peer, third = await offer(http)
    assert third.status_code == 201
    # Shutdown ends every call and frees every slot.
    await state.registry.close_all()
    assert len(state.registry) == 0
    assert (await http.delete(third.headers["location"])).status_code == 404
    for peer in (first_peer, second_peer, third_peer):
        await peer.close()


async def test_api_key_guards_calls_but_not_health(tmp_path: Path) -> None:
    path = write_preset(tmp_path / "preset.yaml", api_key="sesame")
    preset = load_preset(["--config", str(path)], environ={})
    app = create_app(preset, IcePolicy(hosts=("127.0.0.1",)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        refused = await http.post("/v1/realtime/calls", content="v=0", headers={"Content-Type": "application/sdp"})
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        wrong = await http.get("/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert (await http.get("/metrics", headers={"Authorization": "Bearer sesame"})).status_code == 200
        assert (await http.get("/healthz")).status_code == 503  # open, and the pipeline is not loaded
        assert (await http.get("/")).status_code == 200


async def test_the_ice_servers_are_offered_to_the_servers_callers_only(tmp_path: Path) -> None:
    """``--ice-server`` is offered to the browser page (GET /v1/realtime/ice_servers, RTCIceServer
    shape, TURN credentials included) behind the API key; without one, no server at all."""
    path = write_preset(tmp_path / "preset.yaml", api_key="sesame")
    preset = load_preset(["--config", str(path)], environ={})
    servers = ("turn:caller:s3cret@relay.example:3478?transport=udp", "stun:stun.example:3478")
    app = create_app(preset, IcePolicy(tuple(parse_ice_server(s) for s in servers), ("127.0.0.1",)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        assert (await http.get("/v1/realtime/ice_servers")).status_code == 401
        offered = await http.get("/v1/realtime/ice_servers", headers={"Authorization": "Bearer sesame"})
        assert offered.json() == {"ice_servers": [
            {"urls": ["turn:relay.example:3478?transport=udp"], "username": "caller", "credential": "s3cret"},
            {"urls": ["stun:stun.example:3478"]},
        ]}
    bare = create_app(load_preset(["--config", str(write_preset(tmp_path / "bare.yaml"))], environ={}),
                      IcePolicy(hosts=("127.0.0.1",)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=bare), base_url="http://127.0.0.1") as http:
        assert (await http.get("/v1/realtime/ice_servers")).json() == {"ice_servers": []}


async def test_a_multipart_offer_with_a_session_configures_the_call(
        app_state: tuple[httpx.AsyncClient, AppState]) -> None:
    """OpenAI's GA WebRTC flow: ``sdp`` and ``session`` parts in one multipart body (read with
    the body cap while it streams): the call is answered with the session already configured."""
    http, state = app_state
    peer = ClientPeer(ScriptedMic())
    session = {"type": "realtime", "instructions": "Answer in one word."}
    answer = await http.post("/v1/realtime/calls", files={
        "sdp": (None, await peer.offer()), "session": (None, json.dumps(session))})
    assert answer.status_code == 201, answer.text
    await peer.pc.setRemoteDescription(
        RTCSessionDescription(peer.policy.filter_candidates(answer.text), "answer"))
    await peer.wait_for(lambda: any(e["type"] == "session.created" for e in peer.events()))
    created = next(e for e in peer.events() if e["type"] == "session.created")
    assert created["session"]["instructions"] == "Answer in one word."
    await http.delete(answer.headers["location"])
    await peer.close()


async def test_ended_calls_leave_no_objects_behind(app_state: tuple[httpx.AsyncClient, AppState]) -> None:
    """Memory per session: after hang-up, the call, its session, peer, track and resampler are
    freed at once, by reference counting: the cyclic garbage collector is off (as in
    test_closed_sessions.py)."""
    http, state = app_state
    slots: list[weakref.ref[object]] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            peer, answer = await offer(http)
            assert answer.status_code == 201
            await peer.pc.setRemoteDescription(
                RTCSessionDescription(peer.policy.filter_candidates(answer.text), "answer"))
            peer.channel.on("open", peer.notify)
            await peer.wait_for(lambda: peer.channel.readyState == "open")
            mic = peer.pc.getSenders()[0].track
            await mic.say(speech("What is the weather like tomorrow?", 48000, 0.3, 0.0))
            await peer.wait_for(lambda: '"response.done"' in " ".join(peer.messages))
            slot = state.registry.get(answer.headers["location"].rsplit("/", 1)[-1])
            assert slot is not None
            binding = slot.close.__self__  # the SessionBinding that holds the slot
            call = binding.session.transport  # the WebRTCCall that owns the binding
            slots += [weakref.ref(binding), weakref.ref(call), weakref.ref(call.session),
                      weakref.ref(call.peer), weakref.ref(call.peer.outbound),
                      weakref.ref(call.session.audio._resampler)]
            del slot, binding, call
            assert (await http.post(f"{answer.headers['location']}/hangup")).status_code == 200
            await peer.close()
        for _ in range(50):  # aiortc's tasks wind down over a few loop turns after close
            if all(ref() is None for ref in slots):
                break
            await asyncio.sleep(0.02)
        # Before the collector is on again: its first allocation may run a pass.
        alive = [type(ref()).__name__ for ref in slots if ref() is not None]
    finally:
        gc.enable()
    assert not alive, f"still referenced after hang-up: {alive}"


async def test_without_a_key_only_the_servers_own_pages_may_call(tmp_path: Path) -> None:
    """A page on another site must not drive a key-less server from the user's browser."""
    preset = load_preset(["--config", str(write_preset(tmp_path / "preset.yaml"))], environ={})
    app = create_app(preset, IcePolicy(hosts=("127.0.0.1",)))
    sdp = {"Content-Type": "application/sdp"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        foreign = await http.post("/v1/realtime/calls", content="v=0",
                                  headers={**sdp, "Origin": "https://evil.example"})
        assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "cross_origin"
        # The server's own page, and clients that are not browsers, get through to the endpoint.
        own = await http.post("/v1/realtime/calls", content="v=0", headers={**sdp, "Origin": "http://localhost"})
        assert own.status_code == 503  # the pipeline is not loaded in this app
        assert (await http.post("/v1/realtime/calls", content="v=0", headers=sdp)).status_code == 503
    keyed = create_app(load_preset(["--config", str(write_preset(tmp_path / "k.yaml", api_key="k"))],
                                   environ={}), IcePolicy(hosts=("127.0.0.1",)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=keyed), base_url="http://localhost") as http:
        # With a key, the key is the check: a foreign page without it gets 401, not 403.
        response = await http.post("/v1/realtime/calls", content="v=0",
                                    headers={**sdp, "Origin": "https://evil.example"})
        assert response.status_code == 401
