"""``GET /v1/realtime`` with the real ``openai`` SDK as the client, against a real server (toy
preset, stage processes, real silero-vad, espeak-ng speech). Runs in the loopback-only namespace."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Callable
from contextlib import AsyncExitStack, suppress
from pathlib import Path

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed

from duplex.media.pcm import alaw_decode, ulaw_decode
from harness.calls import assert_subsequence
from harness.server import ServerProcess
from harness.speech import speech, speech_wav
from tests.api.helpers import (
    FULL_ANSWER_SAMPLES,
    MAX_SESSIONS,
    PCM_RATE,
    SHORT_ANSWER,
    RealtimeClient,
    aborts,
    answer_samples,
    eventually,
    metric,
    pcm16_b64,
    pipeline_idle,
    realtime,
    rms,
    user_text,
)

QUESTION = "Hello there. Could you tell me what the weather will be like tomorrow?"
FOLLOW_UP = "And what about the day after that?"
INTERRUPTION = "Wait, stop, I have another question for you right now."
MANUAL = {"type": "realtime", "max_output_tokens": SHORT_ANSWER,
          "audio": {"input": {"turn_detection": None}}}


def instructions(text: str) -> dict[str, str]:
    """A harmless session.update."""
    return {"type": "realtime", "instructions": text}


def transcript_of(done: object) -> str:
    return done.response.output[0].content[0].transcript  # type: ignore[attr-defined]


async def manual_turn(rt: RealtimeClient, audio: np.ndarray, n: int) -> object:
    """Append, commit and ask for the ``n``-th response of the connection; its response.done."""
    await rt.append(audio)
    await rt.connection.input_audio_buffer.commit()
    await rt.wait("input_audio_buffer.committed", n)
    await rt.connection.response.create()
    return await rt.wait("response.done", n)


def websocket_sessions(server: ServerProcess) -> float:
    return metric(server, "duplex_sessions_active", {"transport": "websocket"})


async def test_manual_turns_stream_audio_and_transcript(server: ServerProcess) -> None:
    async with realtime(server, model="gpt-realtime-mini") as rt:
        created = await rt.wait("session.created")
        assert created.session.model == "gpt-realtime-mini"
        await rt.connection.session.update(session=MANUAL)
        updated = await rt.wait("session.updated")
        assert updated.session.audio.input.turn_detection is None
        assert updated.session.max_output_tokens == SHORT_ANSWER

        first = await manual_turn(rt, speech(QUESTION, PCM_RATE), 1)
        second = await manual_turn(rt, speech(FOLLOW_UP, PCM_RATE), 2)

    for done in (first, second):
        assert done.response.status == "completed"
        rid = done.response.id
        transcript = transcript_of(done)
        deltas = [e.delta for e in rt.of("response.output_audio_transcript.delta")
                  if e.response_id == rid]
        assert transcript.split() and "".join(deltas) == transcript
        assert len(transcript.split()) == SHORT_ANSWER
        audio = rt.audio(rid)
        assert len(audio) == answer_samples(transcript)
        assert rms(audio) > 0.05
    assert first.response.id != second.response.id
    assert_subsequence(rt.types(), [
        "session.created", "session.updated", "input_audio_buffer.committed",
        "conversation.item.added", "response.created", "response.output_item.added",
        "response.content_part.added", "response.output_audio_transcript.delta",
        "response.output_audio.delta", "response.output_audio.done",
        "response.output_audio_transcript.done", "response.content_part.done",
        "response.output_item.done", "response.done",
        "input_audio_buffer.committed", "response.created", "response.done",
    ])
    # The second turn follows the first answer in the conversation.
    committed = rt.of("input_audio_buffer.committed")[1]
    assert committed.previous_item_id == first.response.output[0].id
    await eventually(lambda: websocket_sessions(server) == 0, "the session's release")


async def test_response_cancel_mid_response(server: ServerProcess) -> None:
    aborted = aborts(server)
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await rt.connection.session.update(session={**MANUAL, "max_output_tokens": "inf"})
        await rt.wait("session.updated")
        await rt.connection.conversation.item.create(item=user_text("A long story."))
        await rt.connection.response.create()
        await rt.wait("response.output_audio.delta")
        await rt.connection.response.cancel()
        done = await rt.wait("response.done")
        assert done.response.status == "cancelled"
        assert done.response.status_details.reason == "client_cancelled"
        # Cut short: less audio than a whole answer, and none after the end.
        assert 0 < len(rt.audio(done.response.id)) < FULL_ANSWER_SAMPLES
        after = rt.types()[rt.types().index("response.done"):]
        assert "response.output_audio.delta" not in after
        # The session goes on: another response, capped, completes.
        await rt.connection.response.create(response={"max_output_tokens": SHORT_ANSWER})
        again = await rt.wait("response.done", 2)
        assert again.response.status == "completed"
    await eventually(lambda: aborts(server) == aborted + 1 and pipeline_idle(server), "the abort")


async def test_server_vad_barge_in_cancels_and_truncates(server: ServerProcess) -> None:
    aborted = aborts(server)
    barge_ins = metric(server, "duplex_barge_ins_total")
    async with realtime(server) as rt:
        created = await rt.wait("session.created")
        assert created.session.audio.input.turn_detection.type == "server_vad"
        response_id = await talk_over_the_agent(rt)
        await rt.append(speech(INTERRUPTION, PCM_RATE, 0.0, 0.0))
        done = await rt.wait("response.done")
        truncated = await rt.wait("conversation.item.truncated")
        assert done.response.id == response_id
        assert done.response.status == "cancelled"
        assert done.response.status_details.reason == "turn_detected"
        types = rt.types()
        starts = [i for i, t in enumerate(types) if t == "input_audio_buffer.speech_started"]
        assert starts[1] < types.index("response.done") < types.index("conversation.item.truncated")
        assert truncated.item_id == done.response.output[0].id
        sent_ms = len(rt.audio(response_id)) * 1000 // PCM_RATE
        assert 1200 <= truncated.audio_end_ms <= sent_ms
        # The interruption is the user's next turn; the client leaves while it is being answered.
        await rt.append(silence(1.0))
        await rt.wait("input_audio_buffer.committed", 2)
        next_id = (await rt.wait("response.created", 2)).response.id
        await rt.wait_for(lambda: len(rt.audio(next_id)))
    assert metric(server, "duplex_barge_ins_total") == barge_ins + 1
    await eventually(lambda: websocket_sessions(server) == 0 and aborts(server) == aborted + 2
                     and pipeline_idle(server), "the cancel and the disconnect's abort")


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * PCM_RATE), dtype=np.float32)


async def talk_over_the_agent(rt: RealtimeClient) -> str:
    """Ask (server VAD); return once the agent sent 1.2 s of its answer (past the echo guard)."""
    await rt.append(speech(QUESTION, PCM_RATE, 0.3, 1.0))
    response_id = (await rt.wait("response.created")).response.id
    await rt.wait_for(lambda: len(rt.audio(response_id)) >= 1.2 * PCM_RATE)
    return response_id


async def round_trip(rt: RealtimeClient, n: int) -> None:
    """Everything the server sent before handling a new event has arrived."""
    await rt.connection.session.update(session=instructions(f"Round trip {n}."))
    await rt.wait("session.updated", n)


async def test_interruption_ending_before_the_cancel_is_answered(server: ServerProcess) -> None:
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await talk_over_the_agent(rt)
        words = speech("I have another question", PCM_RATE, 0.0, 0.0)
        at = [int(s * PCM_RATE) for s in (0.1, 0.5)]
        # Three appends back to back. The server takes a while over the first (5 s of silence), so
        # that the next two arrive together and are handled in one go: the second confirms the
        # interruption (which starts the abort), the third ends the turn before the abort is done.
        for piece in (np.concatenate([silence(5.0), words[:at[0]]]), words[at[0]:at[1]],
                      np.concatenate([words[at[1]:], silence(0.8)])):
            await rt.connection.input_audio_buffer.append(audio=pcm16_b64(piece))
        await rt.wait("conversation.item.truncated")
        await rt.wait("input_audio_buffer.committed", 2)
        await round_trip(rt, 1)
        assert len(rt.of("response.created")) == 2, rt.types()


async def test_interruption_within_one_append_is_confirmed(server: ServerProcess) -> None:
    async with realtime(server) as rt:
        await rt.wait("session.created")
        response_id = await talk_over_the_agent(rt)
        words = np.concatenate([speech(INTERRUPTION, PCM_RATE, 0.0, 0.0), silence(1.0)])
        await rt.connection.input_audio_buffer.append(audio=pcm16_b64(words))
        await round_trip(rt, 1)
        assert len(rt.of("input_audio_buffer.speech_started")) == 2, rt.types()
        done = await rt.wait("response.done")
        assert done.response.id == response_id and done.response.status == "cancelled"


def g711(path: Path, kind: str) -> bytes:
    """A WAV's samples as raw G.711 (``ul`` or ``al``), encoded by sox."""
    done = subprocess.run(["sox", str(path), "-t", kind, "-"], check=True, capture_output=True)
    return done.stdout


@pytest.mark.parametrize(("wire_in", "sox_kind", "wire_out", "decode"), [
    ("audio/pcmu", "ul", "audio/pcma", alaw_decode),
    ("audio/pcma", "al", "audio/pcmu", ulaw_decode),
])
async def test_g711_in_and_out(server: ServerProcess, wire_in: str, sox_kind: str, wire_out: str,
                               decode: Callable[[bytes], np.ndarray]) -> None:
    wav = speech_wav(QUESTION, 8000, 0.5, 1.0)
    source = speech(QUESTION, 8000, 0.5, 1.0)
    onset_ms = int(np.nonzero(np.abs(source) > 0.02)[0][0]) * 1000 // 8000
    encoded = g711(wav, sox_kind)
    async with realtime(server) as rt:
        await rt.wait("session.created")
        formats = {"input": {"format": {"type": wire_in}}, "output": {"format": {"type": wire_out}}}
        await rt.connection.session.update(session={
            "type": "realtime", "max_output_tokens": SHORT_ANSWER, "audio": formats})
        updated = await rt.wait("session.updated")
        assert updated.session.audio.input.format.type == wire_in
        for start in range(0, len(encoded), 800):  # 100 ms of 8 kHz G.711
            chunk = base64.b64encode(encoded[start:start + 800]).decode()
            await rt.connection.input_audio_buffer.append(audio=chunk)
        started = await rt.wait("input_audio_buffer.speech_started")
        done = await rt.wait("response.done")
    # The server VAD heard the speech where it is: the input was decoded right.
    assert abs(started.audio_start_ms - onset_ms) <= 100
    assert done.response.status == "completed"
    answer = b"".join(base64.b64decode(e.delta) for e in rt.of("response.output_audio.delta"))
    expected = answer_samples(transcript_of(done)) // 3  # 24 kHz → 8 kHz, one byte a sample
    assert expected - 64 <= len(answer) <= expected  # the resampler holds back a few samples
    # The toy's first frame is one pure tone: it survives only the right codec (the wrong one, which
    # flips other bits, leaves about half the energy at the tone).
    first_frame = decode(answer[100:540]).astype(np.float32) / 32768
    assert tonality(first_frame) > 0.9


def tonality(samples: np.ndarray) -> float:
    """The share of a signal's energy within a few bins of its strongest frequency."""
    power = np.abs(np.fft.rfft(samples * np.hanning(len(samples)))) ** 2
    peak = int(np.argmax(power))
    return float(power[max(peak - 3, 0):peak + 4].sum() / power.sum())


async def test_bad_events_get_errors_and_the_session_goes_on(server: ServerProcess) -> None:
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await rt.connection.send_raw("this is not json")
        await rt.connection.send_raw(json.dumps({"type": "no.such.event", "event_id": "evt_1"}))
        await rt.connection.input_audio_buffer.append(audio="%%% not base64 %%%")
        await rt.connection.session.update(session={"type": "realtime", "audio": {
            "input": {"turn_detection": {"type": "magic_vad"}}}})
        await rt.connection.input_audio_buffer.commit()  # nothing heard: nothing to commit
        errors = [(await rt.wait("error", n)).error for n in range(1, 6)]
        await rt.connection.session.update(session=instructions("Be brief."))
        updated = await rt.wait("session.updated", 2)
    assert errors[0].code == "invalid_json"
    assert errors[1].code == "unknown_event" and "no.such.event" in errors[1].message
    assert errors[1].event_id == "evt_1"
    assert errors[2].code == "invalid_audio"
    assert errors[3].param == "session.audio.input.turn_detection.type"
    assert errors[4].code == "input_audio_buffer_commit_empty"
    assert updated.session.instructions == "Be brief."
    # The bad field changed nothing.
    assert updated.session.audio.input.turn_detection.type == "server_vad"


async def test_oversized_message_closes_1009_and_others_go_on(server: ServerProcess) -> None:
    async with realtime(server) as other, realtime(server) as big:
        await other.wait("session.created")
        await big.wait("session.created")
        with suppress(ConnectionClosed):  # the close may come while the message is still going out
            await big.connection.send_raw("x" * (17 * 1024 * 1024))
        await big.wait_for(lambda: big.ended)
        assert big.closed is not None and big.closed.rcvd is not None
        assert big.closed.rcvd.code == 1009
        await other.connection.session.update(session=instructions("Still here."))
        assert (await other.wait("session.updated")).session.instructions == "Still here."
    await eventually(lambda: websocket_sessions(server) == 0, "both sessions' release")


async def test_session_limit_refuses_with_1013(server: ServerProcess) -> None:
    async with AsyncExitStack() as stack:
        admitted = [await stack.enter_async_context(realtime(server)) for _ in range(MAX_SESSIONS)]
        for rt in admitted:
            await rt.wait("session.created")
        async with realtime(server) as refused:
            error = await refused.wait("error")
            await refused.wait_for(lambda: refused.ended)
        assert error.error.code == "too_many_sessions"
        assert refused.closed is not None and refused.closed.rcvd.code == 1013
        assert refused.types() == ["error"]
        await admitted[0].connection.session.update(session=instructions("Ok."))
        await admitted[0].wait("session.updated")
    await eventually(lambda: websocket_sessions(server) == 0, "the sessions' release")
    async with realtime(server) as later:
        await later.wait("session.created")
