"""A closed session is freed at once, by reference counting: with Python's cyclic garbage collector
off, nothing of it is left once its connection ended: the connection, its binding, the session,
its playout and its resamplers (each a libswresample filter graph with threads of its own, which
used to wait for the collector's next pass). A live session is full of reference cycles (the
transport owns the session and is its transport, the playout reports to the session, ...);
closing cuts them (``Session._let_go``, ``SessionBinding.end``, ``CallPeer.close``).

The server runs in this process (uvicorn on loopback, the toy pipeline in-process), so that the
test can hold weak references to the server's objects. The WebRTC call's twin is
``test_ended_calls_leave_no_objects_behind`` in test_call_limits.py.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import uvicorn
import websockets

from duplex.app_state import AppState
from duplex.media.pcm import float_to_pcm16, ulaw_encode
from duplex.app import create_app
from duplex.settings import load_preset
from duplex.transports.binding import SessionBinding
from duplex.transports.webrtc.ice import IcePolicy
from harness.calls import QUESTION
from harness.server import free_port, write_preset
from harness.speech import speech
from pipeline.runner import start_pipeline
from tests.api.helpers import eventually

pytestmark = pytest.mark.e2e

TIMEOUT = 20.0


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, AppState]]:
    """(ws:// base URL, the app's state) of a server on loopback in this process."""
    path = write_preset(tmp_path_factory.mktemp("freed") / "preset.yaml")
    preset = load_preset(["--config", str(path)], environ={})
    app = create_app(preset, IcePolicy(hosts=("127.0.0.1",)))
    state: AppState = app.state.duplex
    state.pipeline = await start_pipeline(preset.pipeline, mode="inproc")
    port = free_port()
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                                   log_config=None))
    serving = asyncio.create_task(uvicorn_server.serve())
    async with asyncio.timeout(TIMEOUT):
        while not uvicorn_server.started:
            await asyncio.sleep(0.02)
    yield f"ws://127.0.0.1:{port}", state
    uvicorn_server.should_exit = True
    await serving
    await state.registry.close_all()
    await state.pipeline.close()


@contextmanager
def reference_counting_only() -> Iterator[None]:
    """Python's cyclic garbage collector off: whatever is freed is freed by reference counting."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def the_binding(state: AppState) -> SessionBinding:
    """The binding of the one session the server holds (it holds its registry slot)."""
    [slot] = state.registry._slots.values()
    binding = slot.close.__self__
    assert isinstance(binding, SessionBinding)
    return binding




def realtime_session_refs(state: AppState) -> dict[str, weakref.ref[Any]]:
    """Weak references to the objects of the one Realtime WebSocket session the server holds."""
    binding = the_binding(state)
    session = binding.session
    decoder = binding.events._decoder
    assert decoder is not None
    return {"connection": weakref.ref(session.transport), "binding": weakref.ref(binding),
            "session": weakref.ref(session), "playout": weakref.ref(session.audio),
            "inbound resampler": weakref.ref(decoder._resampler)}


async def assert_freed(refs: dict[str, weakref.ref[Any]], state: AppState) -> None:
    """Every object of ``refs`` is gone once the session ended (its last tasks wind down over a few
    loop turns; a reference cycle would keep it for good, the collector being off)."""
    await eventually(lambda: len(state.registry) == 0, "the session to end")
    for _ in range(100):
        if all(ref() is None for ref in refs.values()):
            return
        await asyncio.sleep(0.02)
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"still alive after the session closed: {alive}"


async def receive_until(ws: websockets.ClientConnection, kind: str, key: str = "type") -> None:
    async with asyncio.timeout(TIMEOUT):
        while json.loads(await ws.recv()).get(key) != kind:
            pass


async def test_a_closed_realtime_websocket_session_is_freed_at_once(
    server: tuple[str, AppState],
) -> None:
    url, state = server
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    audio = base64.b64encode(float_to_pcm16(np.zeros(24000, np.float32)).tobytes()).decode()
    with reference_counting_only():
        async with websockets.connect(f"{url}/v1/realtime?model=toy") as ws:
            await receive_until(ws, "session.created")
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            await ws.send(json.dumps({"type": "conversation.item.create", "item": user}))
            await ws.send(json.dumps({"type": "response.create"}))
            await receive_until(ws, "response.done")
            refs = realtime_session_refs(state)
            # The socket closes while the second answer is being spoken: the session cancels it.
            await ws.send(json.dumps({"type": "response.create"}))
            await receive_until(ws, "response.output_audio.delta")
        await assert_freed(refs, state)


async def test_a_closed_twilio_stream_is_freed_at_once(server: tuple[str, AppState]) -> None:
    url, state = server
    caller = float_to_pcm16(speech(QUESTION, 8000, 0.3, 1.0))
    with reference_counting_only():
        async with websockets.connect(f"{url}/v1/telephony/twilio") as ws:
            await ws.send(json.dumps({"event": "connected"}))
            await ws.send(json.dumps({"event": "start", "streamSid": "MZ1",
                                      "start": {"streamSid": "MZ1", "callSid": "CA1"}}))
            for start in range(0, len(caller), 1600):  # 200 ms a message
                payload = base64.b64encode(ulaw_encode(caller[start:start + 1600])).decode()
                await ws.send(json.dumps({"event": "media", "media": {"payload": payload}}))
                # A source at twice real time: within the stream's real-time budget (1.5x with
                # 2 s bursts) for a clip of a few seconds, so no audio is dropped.
                await asyncio.sleep(0.1)
            await receive_until(ws, "media", "event")  # the agent answers
            binding = the_binding(state)
            session = binding.session
            connection = session.transport
            refs = {"connection": weakref.ref(connection), "binding": weakref.ref(binding),
                    "session": weakref.ref(session), "playout": weakref.ref(session.audio),
                    "inbound resampler": weakref.ref(connection._inbound),
                    "outbound resampler": weakref.ref(connection.playout._resampler)}
            del binding, session, connection
            await ws.send(json.dumps({"event": "stop"}))
        await assert_freed(refs, state)
