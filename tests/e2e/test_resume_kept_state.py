"""A resumed session continues the model's kept state exactly. The tiny Qwen3-Omni preset (the
real classes, random weights, ``keep_model_state``) serves in this process behind a real uvicorn,
and a real WebSocket client drops its TCP connection while the agent speaks, then resumes with its
token. The drop cuts the answer and the thinker's kept state to the audio the server wrote (as a
barge-in does); the turn after the resume continues that kept conversation, and its thinker
tokens are those ``generate`` gives for a fresh request over the history the session shows (the
cut answer's text), token for token. Runs in the loopback-only namespace."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
import websockets

from duplex.app_state import AppState
from duplex.app import create_app
from duplex.settings import load_preset
from duplex.transports.webrtc.ice import IcePolicy
from harness.server import serving, write_preset
from pipeline.models import StageContext, get_model
from pipeline.models.qwen3_omni import loading
from pipeline.models.qwen3_omni import thinker as thinker_module
from pipeline.models.qwen3_omni.reference import load_reference, reference_generate
from pipeline.proto import StagePayload
from pipeline.runner import start_pipeline
from pipeline.scheduling.base import BatchItem
from tests.api.helpers import user_text
from tests.models.cases import talker_cap
from tests.models.test_qwen3_omni_conversation import Recorded, printable_only

pytestmark = pytest.mark.e2e

TIMEOUT = 120.0


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, AppState, Recorded]]:
    """(ws:// URL, the app's state, its pipeline recording each request's thinker tokens)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the stages step from their own threads, in this process
    path = write_preset(tmp_path_factory.mktemp("resume") / "preset.yaml", base="qwen3_omni_tiny",
                        session={"keep_model_state": True, "resume_grace_s": 30})
    preset = load_preset(["--config", str(path)], environ={})
    app = create_app(preset, IcePolicy(hosts=("127.0.0.1",)))
    state: AppState = app.state.duplex
    coordinator = await start_pipeline(preset.pipeline, mode="inproc")
    recorded = Recorded(coordinator)
    state.pipeline = recorded  # type: ignore[assignment]
    async with serving(app) as port:
        yield f"ws://127.0.0.1:{port}/v1/realtime?model=tiny", state, recorded
    await state.registry.close_all()
    await coordinator.close()
    torch.set_num_threads(threads)


async def until(ws: websockets.ClientConnection, kind: str) -> dict[str, Any]:
    async with asyncio.timeout(TIMEOUT):
        while (event := json.loads(await ws.recv()))["type"] != kind:
            pass
    return event


async def test_the_turn_after_a_resume_continues_the_kept_state_exactly(
        server: tuple[str, AppState, Recorded]) -> None:
    url, state, recorded = server
    ws = await websockets.connect(url, max_size=None)
    token = (await until(ws, "session.created"))["session"]["resume_token"]
    await ws.send(json.dumps({"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"turn_detection": None}}}}))
    await until(ws, "session.updated")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(thinker_module, "pick_rows", printable_only)  # an answer that tokenizes back
        await ws.send(json.dumps({"type": "conversation.item.create",
                                  "item": user_text("hello there how are you")}))
        await ws.send(json.dumps({"type": "response.create"}))
        await until(ws, "response.output_audio.delta")
        ws.transport.abort()  # the line drops while the agent speaks

        ws = await websockets.connect(f"{url}&resume_token={token}", max_size=None)
        await until(ws, "session.created")
        done = (await until(ws, "response.done"))["response"]
    assert done["status"] == "cancelled"
    truncated = await until(ws, "conversation.item.truncated")
    await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": truncated["item_id"]}))
    kept = (await until(ws, "conversation.item.retrieved"))["item"]["content"][0]["transcript"]
    spoken = done["output"][0]["content"][0]["transcript"]
    first = recorded.requests[-1]
    answered = recorded.tokens[first.request_id]
    assert len(kept) < len(spoken) and spoken.startswith(kept), (kept, spoken)

    await ws.send(json.dumps({"type": "conversation.item.create", "item": user_text("tell me about the weather")}))
    await ws.send(json.dumps({"type": "response.create"}))
    assert (await until(ws, "response.done"))["response"]["status"] == "completed"
    await ws.close()
    second = recorded.requests[-1]
    assert second is not first and len(answered) > 1
    # The kept conversation went on (not a new one, nor a full prefill) ...
    cid = second.params["conversation_id"]
    assert cid == first.params["conversation_id"]
    assert recorded.coordinator.conversations.book._records[cid].resumed
    # ... and answered what ``generate`` answers over the history with the cut answer's text.
    config = state.preset.pipeline
    stage = config.stage("preprocessing")
    preprocessing = get_model(config.model).factories[stage.runner](StageContext(stage, config.model_args))
    fresh = BatchItem(StagePayload("fresh", {"messages": second.inputs["messages"]}), True)
    assert [m["text"] for m in second.inputs["messages"] if m["role"] == "assistant"] == [kept]
    reference = load_reference(loading.resolve(config.model_args))
    ref = reference_generate(reference, preprocessing.run([fresh])[0],
                             config.stage("thinker").max_new_tokens, talker_cap(config))
    assert recorded.tokens[second.request_id] == ref.tokens
