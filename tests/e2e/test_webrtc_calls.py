"""End to end over WebRTC: a real server process (toy preset, stage processes), real aiortc client
peers, real silero-vad, speech from espeak-ng. Runs in the loopback-only namespace."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from harness.calls import (
    INTERRUPTION,
    QUESTION,
    TIMEOUT,
    assert_subsequence,
    audible_seconds,
    hang_up,
    open_call,
    wait_stages_busy,
    wait_stages_idle,
)
from harness.server import ServerProcess, run_server, write_preset
from harness.speech import speech


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("webrtc")
    # A model paced like a real one (4.8 s to write its 24 tokens, its talker keeping just ahead of
    # playout), so that an interruption lands while every stage still holds the request, even on
    # a loaded machine where playout falls behind. A vanished client's session waits 1 s for a
    # resume (docs/resume.md), then ends.
    preset = write_preset(tmp / "preset.yaml", session={"inbound_media_timeout_s": 3.0,
                                                        "resume_grace_s": 1.0}, stages={
        "thinker": {"options": {"step_delay_s": 0.2, "answer_tokens": 24}},
        "talker": {"options": {"step_delay_s": 0.05}}})
    with run_server(preset, tmp=tmp) as running:
        yield running


async def test_spoken_question_gets_a_spoken_answer(server: ServerProcess) -> None:
    call = await open_call(server)
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    done = await call.wait_event("response.done")
    assert done["response"]["status"] == "completed"
    stopped = await call.wait_event("output_audio_buffer.stopped")
    assert stopped["response_id"] == done["response"]["id"]
    assert_subsequence(call.types(), [
        "session.created", "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed", "conversation.item.added", "response.created",
        "response.output_audio_transcript.delta", "output_audio_buffer.started",
        "response.output_audio_transcript.done", "response.done", "output_audio_buffer.stopped",
    ])
    types = call.types()
    assert types.index("response.output_audio_transcript.delta") < types.index("output_audio_buffer.started")
    transcript = done["response"]["output"][0]["content"][0]["transcript"]
    assert transcript.strip(), done
    started_at = next(t for t, s, _ in call.peer.frames if np.abs(s).max() > 0.05)
    assert call.energy_between(started_at, started_at + 2.0) > 0.05
    assert server.metric("duplex_turns_total") >= 1
    for phase in ("turn_end_to_submit", "submit_to_first_audio", "first_audio_to_playout"):
        assert server.metric("duplex_response_phase_seconds_count", {"phase": phase}) >= 1
    assert server.metric("duplex_outbound_frame_gap_seconds_count") > 50
    await hang_up(server, call)
    await wait_stages_idle(server)


def fragment(word: str, ms: int) -> np.ndarray:
    """The first ``ms`` of voiced audio of ``word``: a click of speech, shorter than a confirmation."""
    samples = speech(word, 48000, 0.0, 0.0)
    start = int(np.nonzero(np.abs(samples) > 0.01)[0][0])
    return samples[start : start + ms * 48]


async def test_barge_in_stops_audio_cancels_and_truncates(server: ServerProcess) -> None:
    barge_ins = server.metric("duplex_barge_ins_total")
    aborts = server.metric("pipeline_abort_clear_seconds_count")
    call = await open_call(server)
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    started = await call.wait_event("output_audio_buffer.started")
    # Past the echo guard (1 s of agent speech), then talk over the agent while every stage is
    # still working on the answer.
    await call.peer.wait_for(lambda: audible_seconds(call) >= 1.2)
    await wait_stages_busy(server)
    call.mic.say(speech(INTERRUPTION, 48000, 0.0, 0.0))
    done = await call.wait_event("response.done")
    assert done["response"]["id"] == started["response_id"]
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    truncated = await call.wait_event("conversation.item.truncated")
    types = call.types()
    second_start = [i for i, t in enumerate(types) if t == "input_audio_buffer.speech_started"][1]
    assert second_start < types.index("output_audio_buffer.cleared") < types.index("response.done") \
        < types.index("conversation.item.truncated")
    item_id = done["response"]["output"][0]["id"]
    assert truncated["item_id"] == item_id
    # The user heard about 1.2 s before talking; the answer was ~5.8 s long.
    assert 900 <= truncated["audio_end_ms"] <= 2600, truncated
    # The abort reached every stage while they held the request, and each acknowledged it.
    assert server.metric("pipeline_abort_clear_seconds_count") >= aborts + 1
    # After the cancel, the agent is quiet while the user keeps talking.
    now = asyncio.get_running_loop().time()
    await call.peer.wait_for(lambda: any(t >= now + 1.0 for t, _, _ in call.peer.frames))
    assert audible_seconds(call, since=now + 0.2) == 0.0
    # The interruption is the user's next turn, and it is answered normally.
    second = await call.wait_event("response.done", count=2)
    assert second["response"]["status"] == "completed"
    assert server.metric("duplex_barge_ins_total") == barge_ins + 1
    await hang_up(server, call)
    await wait_stages_idle(server)


async def test_false_interruption_resumes_the_answer(server: ServerProcess) -> None:
    barge_ins = server.metric("duplex_barge_ins_total")
    pauses = server.metric("duplex_barge_in_stop_seconds_count")
    call = await open_call(server)
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    await call.wait_event("output_audio_buffer.started")
    await call.peer.wait_for(lambda: audible_seconds(call) >= 1.2)
    await call.mic.say(fragment("Hey", 100))
    done = await call.wait_event("response.done")
    assert done["response"]["status"] == "completed"
    await call.wait_event("output_audio_buffer.stopped")
    # The agent paused for the click, resumed, and the answer played to its end; no new turn.
    assert server.metric("duplex_barge_in_stop_seconds_count") == pauses + 1
    assert server.metric("duplex_barge_ins_total") == barge_ins
    assert audible_seconds(call) >= 5.5  # the whole answer (5.76 s)
    assert "conversation.item.truncated" not in call.types()
    assert call.types().count("input_audio_buffer.speech_started") == 1
    await hang_up(server, call)


async def test_concurrent_calls_are_isolated(server: ServerProcess) -> None:
    calls = await asyncio.gather(*(open_call(server) for _ in range(3)))
    questions = [QUESTION, "What time is it?", "Tell me a short story about a cat."]
    for call, question in zip(calls, questions):
        call.mic.say(speech(question, 48000, 0.3, 0.0))
    for call in calls:
        await call.wait_event("output_audio_buffer.started")
    # Interrupt only the first; the others finish their answers.
    await calls[0].peer.wait_for(lambda: audible_seconds(calls[0]) >= 1.2)
    calls[0].mic.say(speech(INTERRUPTION, 48000, 0.0, 0.0))
    results = [await call.wait_event("response.done") for call in calls]
    assert [r["response"]["status"] for r in results] == ["cancelled", "completed", "completed"]
    ids = [{e.get("response", {}).get("id") for e in call.events()} - {None} for call in calls]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    for call in calls:
        await hang_up(server, call)
    await wait_stages_idle(server)


async def test_vanished_client_leaves_nothing_alive(server: ServerProcess) -> None:
    call = await open_call(server)
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    await call.wait_event("response.created")
    # Gone without a word: no hang-up, no DTLS close, no more packets.
    call.mic.stop()
    for transceiver in call.peer.pc.getTransceivers():
        await transceiver.sender.stop()
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while server.metric("duplex_sessions_active", {"transport": "webrtc"}) > 0:
        assert asyncio.get_running_loop().time() < deadline, server.log()[-3000:]
        await asyncio.sleep(0.25)  # the server notices by its inbound-media timeout (3 s here),
        # keeps the session for a resume (1 s here), then ends it
    await wait_stages_idle(server)
    assert "inbound media timeout" in server.log()
    await call.peer.close()


@pytest.mark.parametrize(
    ("body", "content_type", "status", "needle"),
    [
        ("v=0\r\nthis is not sdp", "application/sdp", 400, "audio"),
        ("hello", "text/plain", 415, "content type"),
        (("v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\n"
          "a=rtpmap:96 VP8/90000\r\n"), "application/sdp", 400, "audio"),
    ],
)
async def test_bad_offers_get_clear_errors(server: ServerProcess, body: str, content_type: str,
                                           status: int, needle: str) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{server.url}/v1/realtime/calls", content=body,
                                   headers={"Content-Type": content_type})
        assert response.status_code == status
        assert needle.lower() in response.json()["error"]["message"].lower()
        assert (await http.get(f"{server.url}/healthz")).status_code == 200
        missing = await http.post(f"{server.url}/v1/realtime/calls/rtc_nope/hangup")
        assert missing.status_code == 404
    assert server.metric("duplex_sessions_active", {"transport": "webrtc"}) == 0


async def test_garbage_packets_do_not_hurt_the_call(server: ServerProcess) -> None:
    call = await open_call(server)
    candidate = next(line.split() for line in call.peer.pc.remoteDescription.sdp.splitlines()
                     if line.startswith("a=candidate:"))
    target = (candidate[4], int(candidate[5]))
    rng = np.random.default_rng(7)
    # Random bytes, and random bytes behind the first byte of RTP (0x80), STUN (0x00) and DTLS (0x16).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for i in range(400):
            body = rng.integers(0, 256, int(rng.integers(1, 1400)), dtype=np.uint8).tobytes()
            prefix = (b"", b"\x80", b"\x00\x01", b"\x16\xfe\xfd")[i % 4]
            sock.sendto(prefix + body, target)
    await call.mic.say(speech(QUESTION, 48000, 0.3, 0.0))
    done = await call.wait_event("response.done")
    assert done["response"]["status"] == "completed"
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{server.url}/healthz")).status_code == 200
    await hang_up(server, call)
