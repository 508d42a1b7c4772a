"""A session that waited for a resume leaves nothing behind once it ends: dropped mid-answer,
resumed, dropped again and never resumed, it is freed by reference counting alone (Python's cyclic
garbage collector off), like every closed session (test_closed_sessions.py): the connection, its
binding, the session, its playout and resampler, and the resume store's entry. The server runs in
this process (uvicorn on loopback, the toy pipeline in-process) so that the test can hold weak
references to its objects."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import websockets

from duplex.app_state import AppState
from duplex.media.pcm import float_to_pcm16
from duplex.app import create_app
from duplex.session.resume import ResumeStore
from duplex.settings import load_preset
from duplex.transports.webrtc.ice import IcePolicy
from harness.server import serving, write_preset
from pipeline.runner import start_pipeline
from tests.api.helpers import user_text
from tests.e2e.test_closed_sessions import (
    assert_freed,
    realtime_session_refs,
    receive_until,
    reference_counting_only,
)

pytestmark = pytest.mark.e2e

GRACE_S = 1.0


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, Any]]:
    """(ws:// URL, the app) of a server on loopback in this process."""
    path = write_preset(tmp_path_factory.mktemp("resume_freed") / "preset.yaml",
                        stages={"thinker": {"options": {"answer_tokens": 60}},
                                "talker": {"options": {"step_delay_s": 0.025}}},
                        session={"resume_grace_s": GRACE_S})
    preset = load_preset(["--config", str(path)], environ={})
    app = create_app(preset, IcePolicy(hosts=("127.0.0.1",)))
    state: AppState = app.state.duplex
    state.pipeline = await start_pipeline(preset.pipeline, mode="inproc")
    async with serving(app) as port:
        yield f"ws://127.0.0.1:{port}/v1/realtime?model=toy", app
    await state.registry.close_all()
    await state.pipeline.close()


async def test_a_session_never_resumed_is_freed_at_once(server: tuple[str, Any]) -> None:
    url, app = server
    state: AppState = app.state.duplex
    audio = base64.b64encode(float_to_pcm16(np.zeros(24000, np.float32)).tobytes()).decode()
    with reference_counting_only():
        ws = await websockets.connect(url)
        token = json.loads(await ws.recv())["session"]["resume_token"]
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        await ws.send(json.dumps({"type": "conversation.item.create", "item": user_text("hi")}))
        await ws.send(json.dumps({"type": "response.create"}))
        await receive_until(ws, "response.output_audio.delta")
        refs = realtime_session_refs(state)
        ws.transport.abort()  # dropped mid-answer, resumed, then dropped for good
        ws = await websockets.connect(f"{url}&resume_token={token}")
        await receive_until(ws, "conversation.item.truncated")
        await ws.send(json.dumps({"type": "response.create"}))
        await receive_until(ws, "response.output_audio.delta")
        ws.transport.abort()
        await assert_freed(refs, state)
        store = app.state.duplex.resumes
        assert isinstance(store, ResumeStore) and len(store) == 0
