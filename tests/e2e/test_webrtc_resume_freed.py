"""A WebRTC call that waited for a resume leaves nothing behind once it ends: its peer connection
closed mid-answer, resumed by a new peer, closed again and never resumed, it is freed by reference
counting alone (Python's cyclic garbage collector off), like every closed session
(test_closed_sessions.py): the call, its binding, the session, both peers, the outbound track the
peers were lent, and the store's entry. The app runs in this process (httpx's ASGI transport, the
toy pipeline in-process) so that the test can hold weak references to its objects; the client
peers are real aiortc peers on loopback. Runs in the loopback-only namespace."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from duplex.app_state import AppState
from duplex.app import create_app
from duplex.settings import load_preset
from duplex.transports.webrtc.call import WebRTCCall
from duplex.transports.webrtc.ice import IcePolicy
from harness.calls import answered
from harness.mic import ScriptedMic
from harness.peers import ClientPeer
from harness.server import write_preset
from pipeline.runner import start_pipeline
from tests.api.helpers import eventually, user_text
from tests.e2e.test_closed_sessions import reference_counting_only

pytestmark = pytest.mark.e2e

GRACE_S = 1.0


@pytest.fixture(scope="module")
async def app(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """(a client of the app, the app) in this process."""
    path = write_preset(tmp_path_factory.mktemp("webrtc_resume_freed") / "preset.yaml",
                        stages={"thinker": {"options": {"answer_tokens": 60}},
                                "talker": {"options": {"step_delay_s": 0.025}}},
                        session={"resume_grace_s": GRACE_S})
    preset = load_preset(["--config", str(path)], environ={})
    application = create_app(preset, IcePolicy(hosts=("127.0.0.1",)))
    state: AppState = application.state.duplex
    state.pipeline = await start_pipeline(preset.pipeline, mode="inproc")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application),
                                 base_url="http://localhost") as http:
        yield http, application
    await state.registry.close_all()
    await state.pipeline.close()


async def connect(http: httpx.AsyncClient, token: str | None = None) -> tuple[ClientPeer, str]:
    """A client peer with its events channel open and ``session.created`` in; the call's path."""
    mic = ScriptedMic()
    peer = ClientPeer(mic)
    answer = await http.post("/v1/realtime/calls", content=await peer.offer(),
                             params={"resume_token": token} if token else None,
                             headers={"Content-Type": "application/sdp"})
    return peer, (await answered(peer, mic, answer)).path


def events(peer: ClientPeer, kind: str) -> list[dict[str, Any]]:
    return [e for e in peer.events() if e["type"] == kind]


async def test_a_resumed_call_never_resumed_again_is_freed_at_once(
        app: tuple[httpx.AsyncClient, Any]) -> None:
    http, application = app
    state: AppState = application.state.duplex
    with reference_counting_only():
        first, path = await connect(http)
        await first.wait_for(lambda: events(first, "session.created"))
        token = events(first, "session.created")[0]["session"]["resume_token"]
        first.send({"type": "conversation.item.create", "item": user_text("hi")})
        first.send({"type": "response.create"})
        await first.wait_for(lambda: events(first, "output_audio_buffer.started"))
        slot = state.registry.get(path.rsplit("/", 1)[-1])
        assert slot is not None
        call = slot.close.__self__.session.transport  # the WebRTCCall that owns the binding
        assert isinstance(call, WebRTCCall) and call.peer is not None
        refs = {"call": weakref.ref(call), "binding": weakref.ref(call.binding),
                "session": weakref.ref(call.session), "first peer": weakref.ref(call.peer),
                "track": weakref.ref(call.outbound)}
        del slot, call
        await first.close()  # lost mid-answer, resumed, then lost for good
        await eventually(lambda: (s := state.registry.get(path.rsplit("/", 1)[-1])) is not None
                         and s.detached, "the session to wait")
        second, _ = await connect(http, token)
        await second.wait_for(lambda: events(second, "conversation.item.truncated"))
        slot = state.registry.get(path.rsplit("/", 1)[-1])
        assert slot is not None
        refs["second peer"] = weakref.ref(slot.close.__self__.session.transport.peer)
        del slot
        second.send({"type": "response.create"})
        await second.wait_for(lambda: len(events(second, "response.created")) >= 1)
        await second.close()
        await eventually(lambda: len(state.registry) == 0, "the session to end", GRACE_S + 20)
        for _ in range(100):  # aiortc's tasks wind down over a few loop turns after close
            if all(ref() is None for ref in refs.values()):
                break
            await asyncio.sleep(0.02)
        alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"still alive after the session ended: {alive}"
    assert len(application.state.duplex.call_resumes) == 0  # the store's entry went with it
