"""WebRTC calls that survive a lost peer connection (docs/resume.md): a real server process (toy
preset with long answers, an API key, a grace period of a few seconds, a short inbound-media
timeout), real aiortc client peers, speech from espeak-ng. A client whose peer connection is lost
(closed abruptly, or gone quiet) makes a new peer and offers it with the token of its
``session.created``; the session goes on through it. Runs in the loopback-only namespace."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.calls import QUESTION, TIMEOUT, Call, answered, assert_subsequence, audible_seconds
from harness.mic import ScriptedMic
from harness.peers import ClientPeer
from harness.server import ServerProcess, run_server, write_preset
from harness.speech import speech
from tests.api.helpers import (
    ANSWER_WORDS,
    API_KEY,
    AUTH,
    FRAMES_PER_WORD,
    PIPELINE,
    SHORT_ANSWER,
    eventually,
    metric,
    pipeline_idle,
    user_text,
)

pytestmark = pytest.mark.e2e

GRACE_S = 6.0
INBOUND_TIMEOUT_S = 2.0
MS_PER_WORD = FRAMES_PER_WORD * 80  # the toy's 80 ms codec frames
RTC = {"transport": "webrtc"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("webrtc_resume")
    preset = write_preset(tmp / "preset.yaml", pipeline=PIPELINE, api_key=API_KEY, session={
        "resume_grace_s": GRACE_S, "inbound_media_timeout_s": INBOUND_TIMEOUT_S})
    with run_server(preset, tmp=tmp) as running:
        yield running


async def offer(server: ServerProcess, token: str | None = None, key: str = API_KEY,
                multipart: bool = False, sdp: str | None = None) -> tuple[ClientPeer, httpx.Response]:
    """A new client peer and the server's answer to its offer (``token``: a resume, as the query
    parameter or, ``multipart``, as the form's ``resume_token`` part)."""
    peer = ClientPeer(ScriptedMic())
    body = sdp if sdp is not None else await peer.offer()
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        if multipart:
            parts: dict[str, Any] = {"sdp": (None, body)}
            if token is not None:
                parts["resume_token"] = (None, token)
            response = await http.post(f"{server.url}/v1/realtime/calls", files=parts, headers=headers)
        else:
            response = await http.post(f"{server.url}/v1/realtime/calls", content=body,
                                       params={"resume_token": token} if token is not None else None,
                                       headers={**headers, "Content-Type": "application/sdp"})
    return peer, response


async def connect(peer: ClientPeer, answer: httpx.Response) -> Call:
    """The call ``answer`` (a 201 to ``peer``'s offer) opens, with ``peer``'s microphone."""
    mic = peer.pc.getSenders()[0].track
    assert isinstance(mic, ScriptedMic)
    return await answered(peer, mic, answer)


async def open_call(server: ServerProcess, token: str | None = None, **how: Any) -> Call:
    peer, answer = await offer(server, token, **how)
    return await connect(peer, answer)


def created(call: Call, count: int = 1) -> dict[str, Any]:
    return [e for e in call.events() if e["type"] == "session.created"][count - 1]["session"]


async def refused(server: ServerProcess, token: str, **how: Any) -> dict[str, Any]:
    """The error of a resume the server refuses; no session is made for it."""
    made = metric(server, "duplex_sessions_total", RTC)
    peer, answer = await offer(server, token, **how)
    await peer.close()
    assert answer.status_code == 400, answer.text
    assert metric(server, "duplex_sessions_total", RTC) == made
    return answer.json()["error"]


def waiting(server: ServerProcess) -> float:
    return metric(server, "duplex_sessions_awaiting_resume", RTC)


def live(server: ServerProcess) -> float:
    return metric(server, "duplex_sessions_active", RTC)


async def dropped(server: ServerProcess, call: Call) -> None:
    """Close ``call``'s peer connection abruptly (no hang-up), and wait until the server holds its
    session for a resume."""
    await call.peer.close()
    await eventually(lambda: waiting(server) == 1 and live(server) == 1, "the session to wait")


async def released(server: ServerProcess, within: float = TIMEOUT) -> None:
    await eventually(lambda: live(server) == 0 and waiting(server) == 0 and pipeline_idle(server),
                     "the session's release", within)


async def retrieve(call: Call, item_id: str) -> dict[str, Any]:
    call.peer.send({"type": "conversation.item.retrieve", "item_id": item_id})
    return (await call.wait_event("conversation.item.retrieved", item__id=item_id))["item"]


async def test_a_dropped_call_goes_on_through_a_new_peer(server: ServerProcess) -> None:
    first = await open_call(server)
    session = created(first)
    token = session["resume_token"]
    assert token.startswith("rsm_")
    first.peer.send({"type": "session.update", "session": {
        "type": "realtime", "instructions": "Remember the pineapple.",
        "max_output_tokens": SHORT_ANSWER}})
    await first.wait_event("session.updated")
    # A spoken turn, answered in full ...
    await first.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    answered = (await first.wait_event("response.done"))["response"]
    assert answered["status"] == "completed"
    await first.wait_event("output_audio_buffer.stopped")
    # ... then a long answer, lost while it plays.
    since = time.monotonic()
    first.peer.send({"type": "conversation.item.create", "item": user_text("Tell me a long story.")})
    first.peer.send({"type": "response.create", "response": {"max_output_tokens": "inf"}})
    cut = (await first.wait_event("response.created", count=2))["response"]["id"]
    await first.wait_event("output_audio_buffer.started", response_id=cut)
    await first.peer.wait_for(lambda: audible_seconds(first, since) >= 1.0, TIMEOUT)
    heard_ms = audible_seconds(first, since) * 1000
    await dropped(server, first)

    second = await open_call(server, token)
    assert second.path == first.path
    again = created(second)
    assert again["id"] == session["id"]
    assert again["instructions"] == "Remember the pineapple."
    assert again["resume_token"] not in (None, token)
    assert second.types()[0] == "session.created"
    assert waiting(server) == 0 and live(server) == 1
    # What the session said while nobody listened: the lost answer cut where its audio stopped.
    done = (await second.wait_event("response.done"))["response"]
    assert done["id"] == cut and done["status"] == "cancelled"
    truncated = await second.wait_event("conversation.item.truncated")
    assert_subsequence(second.types(), ["session.created", "response.done", "conversation.item.truncated"])
    assert truncated["item_id"] == done["output"][0]["id"]
    # Cut at the audio the old peer sent: at least what its client got, far from all of it.
    assert heard_ms - 200 <= truncated["audio_end_ms"] < ANSWER_WORDS * MS_PER_WORD / 2, (
        heard_ms, truncated)
    # The conversation is there: every item, the cut answer as far as it was heard.
    items = [e["item"]["id"] for e in first.events() if e["type"] == "conversation.item.added"]
    assert len(items) == 4  # the spoken turn, its answer, the text turn, the cut answer
    for item_id in items:
        assert (await retrieve(second, item_id))["id"] == item_id
    kept = await retrieve(second, truncated["item_id"])
    assert kept["status"] == "incomplete"
    assert done["output"][0]["content"][0]["transcript"].startswith(kept["content"][0]["transcript"])
    # The next turn is heard from the new peer and answered with audio on its track.
    await second.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    next_turn = await second.wait_event("response.done", count=2)
    assert next_turn["response"]["status"] == "completed"
    await second.wait_event("output_audio_buffer.stopped", response_id=next_turn["response"]["id"])
    assert audible_seconds(second) >= 0.5
    # A hang-up ends it for good, and the token with it.
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        assert (await http.post(f"{server.url}{second.path}/hangup", headers=AUTH)).status_code == 200
    await second.peer.close()
    await released(server)
    assert (await refused(server, again["resume_token"]))["code"] == "invalid_resume_token"


async def test_tokens_are_single_use_bound_to_the_key_and_an_events_channel_close_hangs_up(
        server: ServerProcess) -> None:
    first = await open_call(server)
    token = created(first)["resume_token"]
    await dropped(server, first)
    # Another credential (a client secret minted with the same key) cannot take it over; nor can
    # a made-up token; a bad offer is refused before its token is used.
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        minted = (await http.post(f"{server.url}/v1/realtime/client_secrets", headers=AUTH, json={})).json()
    error = await refused(server, token, key=minted["value"])
    assert error["code"] == "invalid_resume_token" and error["param"] == "resume_token"
    assert (await refused(server, "rsm_" + "x" * 43))["code"] == "invalid_resume_token"
    assert (await refused(server, token, sdp="v=0\r\nnot sdp"))["code"] == "invalid_sdp"
    assert waiting(server) == 1 and live(server) == 1
    # The token, as the multipart body's part, resumes it once.
    second = await open_call(server, token, multipart=True)
    renewed = created(second)["resume_token"]
    assert created(second)["id"] == created(first)["id"]
    assert (await refused(server, token))["code"] == "invalid_resume_token"
    # A client that closes its events channel (its connection still up) has hung up: the session
    # ends at once, long before a grace period would, and its token with it.
    second.peer.channel.close()
    await released(server, within=GRACE_S / 2)
    assert (await refused(server, renewed))["code"] == "invalid_resume_token"
    await second.peer.close()


async def test_a_quiet_peer_is_detached_then_freed_when_nobody_resumes(server: ServerProcess) -> None:
    call = await open_call(server)
    token = created(call)["resume_token"]
    # Gone without a word: no hang-up, no close, no more packets. The server notices by its
    # inbound-media timeout, and keeps the session for a resume.
    for transceiver in call.peer.pc.getTransceivers():
        await transceiver.sender.stop()
    await eventually(lambda: waiting(server) == 1, "the session to wait", INBOUND_TIMEOUT_S + TIMEOUT)
    assert live(server) == 1
    # Nobody comes back: after the grace period the session ends, its slot and gauge go down.
    await released(server, within=GRACE_S + TIMEOUT)
    assert "no resume within the grace period" in server.log()
    assert (await refused(server, token))["code"] == "invalid_resume_token"
    await call.peer.close()
