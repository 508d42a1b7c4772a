"""A WebRTC call resumed by a new peer continues the model's kept state exactly, as a resumed
WebSocket session does (test_resume_kept_state.py, whose server this module shares: the tiny
Qwen3-Omni preset with ``keep_model_state``, in this process behind a real uvicorn). A real aiortc
client closes its peer connection while the agent speaks, then offers a new peer with its token;
the cut answer and the thinker's kept state end where the old peer's audio stopped, and the next
turn's thinker tokens are those ``generate`` gives for a fresh request over the history the
session shows, token for token. Runs in the loopback-only namespace."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from duplex.app_state import AppState
from harness.calls import TIMEOUT, Call, answered
from harness.mic import ScriptedMic
from harness.peers import ClientPeer
from pipeline.models import StageContext, get_model
from pipeline.models.qwen3_omni import loading
from pipeline.models.qwen3_omni import thinker as thinker_module
from pipeline.models.qwen3_omni.reference import load_reference, reference_generate
from pipeline.proto import StagePayload
from pipeline.scheduling.base import BatchItem
from tests.api.helpers import eventually, user_text
from tests.e2e.test_resume_kept_state import server  # noqa: F401  (the shared server fixture)
from tests.models.cases import talker_cap
from tests.models.test_qwen3_omni_conversation import Recorded, printable_only

pytestmark = pytest.mark.e2e


async def open_call(base: str, token: str | None = None) -> Call:
    """A WebRTC call to ``base`` (a resume with ``token``), its events channel open and
    ``session.created`` in."""
    mic = ScriptedMic()
    peer = ClientPeer(mic)
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        answer = await http.post(f"{base}/v1/realtime/calls", content=await peer.offer(),
                                 params={"resume_token": token} if token else None,
                                 headers={"Content-Type": "application/sdp"})
    return await answered(peer, mic, answer)


async def test_a_resumed_call_continues_the_kept_state_exactly(
        server: tuple[str, AppState, Recorded], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    url, state, recorded = server
    # A WebRTC call asks its pipeline what the model takes in (a camera for a model that sees).
    monkeypatch.setattr(recorded, "input_modalities", recorded.coordinator.input_modalities,
                        raising=False)
    base = "http" + url.removeprefix("ws").split("/v1/")[0]
    first = await open_call(base)
    session: dict[str, Any] = first.events()[0]["session"]
    first.peer.send({"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"turn_detection": None}}}})
    await first.wait_event("session.updated")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(thinker_module, "pick_rows", printable_only)  # an answer that tokenizes back
        first.peer.send({"type": "conversation.item.create", "item": user_text("hello there how are you")})
        first.peer.send({"type": "response.create"})
        await first.wait_event("output_audio_buffer.started")
        await first.peer.close()  # the peer connection is lost while the agent speaks
        await eventually(lambda: (slot := state.registry.get(session["id"])) is not None
                         and slot.detached, "the session to wait for a resume")
        second = await open_call(base, session["resume_token"])
        done = (await second.wait_event("response.done"))["response"]
    assert second.events()[0]["session"]["id"] == session["id"]
    assert done["status"] == "cancelled"
    truncated = await second.wait_event("conversation.item.truncated")
    second.peer.send({"type": "conversation.item.retrieve", "item_id": truncated["item_id"]})
    kept = (await second.wait_event("conversation.item.retrieved"))["item"]["content"][0]["transcript"]
    spoken = done["output"][0]["content"][0]["transcript"]
    first_request = recorded.requests[-1]
    answered = recorded.tokens[first_request.request_id]
    assert len(kept) < len(spoken) and spoken.startswith(kept), (kept, spoken)

    second.peer.send({"type": "conversation.item.create", "item": user_text("tell me about the weather")})
    second.peer.send({"type": "response.create"})
    assert (await second.wait_event("response.done", count=2))["response"]["status"] == "completed"
    next_request = recorded.requests[-1]
    assert next_request is not first_request and len(answered) > 1
    # The kept conversation went on (not a new one, nor a full prefill) ...
    cid = next_request.params["conversation_id"]
    assert cid == first_request.params["conversation_id"]
    assert recorded.coordinator.conversations.book._records[cid].resumed
    # ... and answered what ``generate`` answers over the history with the cut answer's text.
    config = state.preset.pipeline
    stage = config.stage("preprocessing")
    preprocessing = get_model(config.model).factories[stage.runner](StageContext(stage, config.model_args))
    fresh = BatchItem(StagePayload("fresh", {"messages": next_request.inputs["messages"]}), True)
    assert [m["text"] for m in next_request.inputs["messages"] if m["role"] == "assistant"] == [kept]
    reference = load_reference(loading.resolve(config.model_args))
    ref = reference_generate(reference, preprocessing.run([fresh])[0],
                             config.stage("thinker").max_new_tokens, talker_cap(config))
    assert recorded.tokens[next_request.request_id] == ref.tokens
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        assert (await http.post(f"{base}{second.path}/hangup")).status_code == 200
    await second.peer.close()
