"""Session behaviour against a scripted pipeline (a fake of ``ModelPipeline``, named as such: it
stands in for the model so a test decides exactly when each chunk arrives), with the real VAD, the
real paced track on a virtual clock, and the real transport binding.

What the real-pipeline tests cannot pin down: a turn that ends while the interrupted response is
still being cancelled, a stream that fails midway, the model's transcript of the user's turn, and
truncation by the exact text each audio chunk voices.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

from duplex.media.paced_track import OutboundAudioTrack
from duplex.media.playout import ClientPlayout, PacedPlayout
from duplex.registry import SessionRegistry
from duplex.session import client_events
from duplex.session.client_events import ClientEvents
from duplex.session.session import Session
from duplex.settings import SessionDefaults
from duplex.transports.binding import SessionBinding
from harness.scripted_pipeline import ScriptedPipeline
from harness.speech import speech

STEP = 320  # 20 ms at 16 kHz
RATE = 24000
TIMEOUT = 20.0


class Host:
    """A transport that records events, with a paced track on a clock that moves 20 ms a step."""

    kind = "webrtc"

    def __init__(self, pipeline: ScriptedPipeline, **defaults: Any) -> None:
        self.clock = 0.0
        self.events: list[dict[str, Any]] = []
        self.track = OutboundAudioTrack(clock=lambda: self.clock)
        self.session = Session("sess_scripted", self, PacedPlayout(self.track), pipeline,
                               SessionDefaults(**defaults), ["default"], "scripted")
        self.binding = SessionBinding(self.session, SessionRegistry(4), self._close)
        self.binding.admit()
        self.binding.start()

    async def _close(self, reason: str) -> None:
        await self.binding.end(reason)

    def send_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    async def step(self, mic: np.ndarray) -> None:
        self.session.on_audio(mic)
        self.clock += 0.02
        await self.track.recv()
        await asyncio.sleep(0)  # as the real track's wait would: let the session's tasks run

    async def feed(self, audio: np.ndarray) -> None:
        for i in range(0, len(audio) - STEP + 1, STEP):
            await self.step(audio[i : i + STEP])

    async def silence(self, frames: int) -> None:
        await self.feed(np.zeros(frames * STEP, dtype=np.float32))

    async def until(self, condition: Any) -> None:
        async with asyncio.timeout(TIMEOUT):
            while not condition():
                await asyncio.sleep(0.001)


def tone(seconds: float) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)


async def ask(host: Host, pipeline: ScriptedPipeline, text: str = "What is the capital of France?") -> None:
    await host.feed(speech(text, 16000, 0.3, 0.0))
    await host.silence(30)
    await host.until(lambda: len(pipeline.requests) >= 1 and "response.created" in host.types())


async def test_a_turn_ending_during_the_cancel_is_answered_after_the_truncation() -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline)
    await ask(host, pipeline)
    pipeline.push(text="Paris is the capital. ", audio=tone(3.0), sample_rate=RATE,
                  spoken_text="Paris is the capital. ")
    await host.until(lambda: host.track.queued_seconds >= 2.9)
    await host.silence(75)  # 1.5 s of the answer played, past the echo guard
    # The abort hangs until the test lets it through: the user's whole next turn ends meanwhile.
    release = asyncio.Event()
    real_abort = pipeline.abort

    async def slow_abort(request_id: str, keep_answer_tokens: int | None = None) -> None:
        await release.wait()
        await real_abort(request_id, keep_answer_tokens)

    pipeline.abort = slow_abort  # type: ignore[method-assign]
    await host.feed(speech("And of Spain?", 16000, 0.0, 0.0))
    await host.silence(30)
    assert host.types().count("input_audio_buffer.committed") == 2
    assert len(pipeline.requests) == 1, "answered before the interrupted response was done"
    release.set()
    await host.until(lambda: len(pipeline.requests) == 2)
    types = host.types()
    assert types.index("conversation.item.truncated") < types.index("response.created", types.index(
        "response.done"))
    # The second request's history ends with the truncated answer's heard text, then the new turn.
    messages = pipeline.requests[1].inputs["messages"]
    assert [m["role"] for m in messages[-3:]] == ["user", "assistant", "user"]
    heard = messages[-2]["text"]
    assert heard and "Paris is the capital.".startswith(heard.strip()), heard
    pipeline.end()
    await host.binding.end("test over")


async def test_a_side_answer_is_cancelled_by_its_id_while_the_spoken_one_goes_on() -> None:
    """An out-of-band text answer beside the spoken one: ``response.cancel`` with its id aborts
    it (and only it) while it is still running; the spoken answer plays to its end."""
    pipeline = ScriptedPipeline()
    host = Host(pipeline)
    await ask(host, pipeline)
    main = pipeline.requests[0].request_id
    pipeline.push(text="Paris. ", audio=tone(0.5), sample_rate=RATE)
    host.binding.receive(json.dumps({"type": "response.create", "response": {
        "conversation": "none", "output_modalities": ["text"]}}))
    await host.until(lambda: len(pipeline.requests) == 2)
    side = pipeline.requests[1].request_id
    pipeline.push(request_id=side, text="The user is curious")
    side_id = host.of("response.created")[1]["response"]["id"]
    host.binding.receive(json.dumps({"type": "response.cancel", "response_id": side_id}))
    await host.until(lambda: len(host.of("response.done")) == 1)
    done = host.of("response.done")[0]["response"]
    assert (done["id"], done["status"]) == (side_id, "cancelled")
    assert pipeline.aborted == [side]
    pipeline.end(main)
    for _ in range(100):  # 0.5 s of answer, and more
        if len(host.of("response.done")) >= 2:
            break
        await host.silence(5)
    assert len(host.of("response.done")) == 2, "the spoken answer never ended"
    assert host.of("response.done")[1]["response"]["status"] == "completed"
    assert pipeline.aborted == [side]
    await host.binding.end("test over")


async def test_a_stream_failing_midway_reports_an_error_and_fails_the_response() -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline)
    await ask(host, pipeline)
    pipeline.push(text="Par")
    pipeline.fail("stage crashed: boom")
    await host.until(lambda: "response.done" in host.types())
    done = host.of("response.done")[0]["response"]
    assert done["status"] == "failed" and "boom" in done["status_details"]["error"]["message"]
    assert "boom" in host.of("error")[0]["error"]["message"]
    assert host.session.response is None and host.session.state == "listening"
    await host.binding.end("test over")


async def test_the_models_transcript_becomes_the_user_turns_text() -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline)
    await ask(host, pipeline)
    pipeline.push(input_transcript="What is the capital of France?")
    pipeline.push(text="Paris.")
    pipeline.end()
    await host.until(lambda: "conversation.item.input_audio_transcription.completed" in host.types())
    event = host.of("conversation.item.input_audio_transcription.completed")[0]
    user = host.session.history.get(event["item_id"])
    assert user is not None and user.role == "user" and user.text == event["transcript"]
    assert host.types().index("conversation.item.input_audio_transcription.completed") < \
        host.types().index("response.output_audio_transcript.delta")
    # One delta, the whole text, just before the completed event (the recogniser writes at once).
    (delta,) = host.of("conversation.item.input_audio_transcription.delta")
    assert (delta["item_id"], delta["delta"]) == (user.id, event["transcript"])
    assert host.types().index(delta["type"]) + 1 == host.types().index(event["type"])
    assert "conversation.item.input_audio_transcription.failed" not in host.types()
    await host.binding.end("test over")


async def test_a_turn_answered_without_the_transcript_the_client_asked_for_fails_its_transcription() -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline)
    host.binding.receive(json.dumps({"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}}))
    await host.until(lambda: "session.updated" in host.types())
    await ask(host, pipeline)
    assert pipeline.requests[0].params["transcribe"] is True
    pipeline.push(text="Paris.")
    pipeline.end()
    await host.until(lambda: "conversation.item.input_audio_transcription.failed" in host.types())
    (failed,) = host.of("conversation.item.input_audio_transcription.failed")
    assert failed["item_id"] == host.of("input_audio_buffer.committed")[0]["item_id"]
    assert failed["error"]["code"] == "not_transcribed"
    await host.binding.end("test over")


async def test_truncation_keeps_exactly_the_voiced_text_that_was_heard() -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline)
    await ask(host, pipeline)
    clauses = ["First clause here, ", "second clause there, ", "third one at the end."]
    for clause in clauses:  # one second of audio each, each voicing exactly its clause
        pipeline.push(text=clause)
        pipeline.push(audio=tone(1.0), sample_rate=RATE, spoken_text=clause)
    await host.until(lambda: host.track.queued_seconds >= 2.9)
    await host.silence(75)  # 1.5 s heard (after the first chunk's start): inside the second clause
    await host.feed(speech("Stop there please.", 16000, 0.0, 0.0))
    await host.until(lambda: "conversation.item.truncated" in host.types())
    truncated = host.of("conversation.item.truncated")[0]
    item = host.session.history.get(truncated["item_id"])
    assert item is not None
    share = (truncated["audio_end_ms"] - 1000) / 1000
    assert 0.2 < share < 0.9, truncated
    assert item.transcript.startswith(clauses[0] + "second")
    assert "third" not in item.transcript
    kept_of_second = len(item.transcript) - len(clauses[0])
    assert abs(kept_of_second / len(clauses[1]) - share) < 0.35
    await host.binding.end("test over")


async def test_a_failing_event_handler_becomes_an_error_event_and_later_events_still_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline)

    async def broken(events: ClientEvents, message: dict[str, Any]) -> None:
        raise RuntimeError("a bug in a handler")

    monkeypatch.setitem(client_events._HANDLERS, "input_audio_buffer.clear", broken)
    host.binding.receive('{"type": "input_audio_buffer.clear", "event_id": "ev_1"}')
    host.binding.receive("{not json")
    host.binding.receive('{"type": "session.update", "session": {"instructions": "Be brief."}}')
    await host.until(lambda: "session.updated" in host.types())
    errors = [e["error"] for e in host.of("error")]
    assert [e["code"] for e in errors] == ["server_error", "invalid_json"]
    assert errors[0]["event_id"] == "ev_1"
    assert host.of("session.updated")[0]["session"]["instructions"] == "Be brief."
    await host.binding.close()
    assert host.binding.ended.is_set()


async def test_where_the_client_plays_the_audio_onset_cancels_at_once() -> None:
    """WebSocket: the client plays the audio, so speech_started goes out at the onset (it stops
    playing now) and the response is cancelled; there is no paused audio to resume."""
    pipeline = ScriptedPipeline()
    host = Host(pipeline)
    host.session.audio = ClientPlayout()
    host.session.audio.listener = host.session
    await ask(host, pipeline)
    pipeline.push(text="A long answer. ", audio=tone(2.0), sample_rate=RATE)
    await host.until(lambda: "response.output_audio.delta" in host.types())
    host.session._detector.reset()  # a fresh stream position: the next onset is at a known time
    word = speech("Hey", 16000, 0.0, 0.0)
    onset = int(np.nonzero(np.abs(word) > 0.01)[0][0])
    # 100 ms of speech: less than interrupt_min_speech_ms, which a paced transport waits for.
    for i in range(onset, onset + 1600, STEP):
        host.session.on_audio(word[i : i + STEP])
    assert len(host.of("input_audio_buffer.speech_started")) == 2, "no speech_started at the onset"
    await host.until(lambda: "response.done" in host.types())
    assert host.of("response.done")[0]["response"]["status"] == "cancelled"
    assert pipeline.aborted == [pipeline.requests[0].request_id]
    await host.binding.end("test over")


async def test_kept_model_state_follows_the_conversation_and_is_cut_to_what_was_heard() -> None:
    """keep_model_state: turns that extend the history continue one conversation; a barge-in
    keeps the answer tokens voiced by the audio being heard, and the history the text of exactly
    those tokens; an edit starts a new conversation."""
    pipeline = ScriptedPipeline()
    host = Host(pipeline, keep_model_state=True)
    await ask(host, pipeline)
    first = pipeline.requests[0].params["conversation_id"]
    # One answer token a text chunk; the first token's text comes with the second's (a character
    # split across tokens), so its chunk has no text.
    pieces = ["", "Paris ", "is ", "the ", "capital ", "of ", "France, ", "a ", "city ", "of ",
              "art ", "and ", "of ", "light ", "too."]
    for piece in pieces:
        pipeline.push(text=piece, text_tokens=1)
    for tokens in (4, 9, 15):  # one second of audio each, voicing 4, then 9, then 15 tokens
        pipeline.push(audio=tone(1.0), sample_rate=RATE, answer_tokens=tokens)
    await host.until(lambda: host.track.queued_seconds >= 2.9)
    await host.silence(75)  # 1.5 s heard: inside the second chunk
    await host.feed(speech("Wait a moment.", 16000, 0.0, 0.0))
    await host.silence(30)
    await host.until(lambda: len(pipeline.requests) == 2)
    assert pipeline.kept_on_abort == [9]
    assert pipeline.requests[1].params["conversation_id"] == first  # continued after the cut
    # The next request's history says what the kept state holds: the text of those 9 tokens.
    assistant = pipeline.requests[1].inputs["messages"][-2]
    assert assistant["role"] == "assistant" and assistant["text"] == "".join(pieces[:9])
    pipeline.end()
    await host.until(lambda: host.session.response is None)
    # Deleting an earlier item is an edit the kept state cannot follow: a new conversation.
    host.session.conversation.delete(host.session.history.items[0].id)
    await host.feed(speech("And now?", 16000, 0.3, 0.0))
    await host.silence(30)
    await host.until(lambda: len(pipeline.requests) == 3)
    assert pipeline.requests[2].params["conversation_id"] != first
    await host.until(lambda: pipeline.closed_conversations == [first])
    pipeline.end()
    await host.binding.end("test over")
    assert len(pipeline.closed_conversations) == 2  # the session's end frees the last one


PIECES = ["", "Paris ", "is ", "the ", "capital ", "of ", "France, ", "a ", "city ", "of ",
          "art ", "and ", "of ", "light ", "too."]


async def _answered_on_the_client(pipeline: ScriptedPipeline, counted: bool = True) -> Host:
    """A kept-state session whose client plays the audio (the Realtime WebSocket), after one turn
    answered in full: one answer token a text chunk, three seconds of audio voicing 4, 9 and 15
    tokens (where ``counted``: else the model does not say)."""
    host = Host(pipeline, keep_model_state=True)
    host.session.audio = ClientPlayout()
    host.session.audio.listener = host.session
    await ask(host, pipeline)
    for piece in PIECES:
        pipeline.push(text=piece, text_tokens=1 if counted else None)
    for tokens in (4, 9, 15):
        pipeline.push(audio=tone(1.0), sample_rate=RATE, answer_tokens=tokens if counted else None)
    pipeline.end()
    await host.until(lambda: "response.done" in host.types())
    return host


async def _client_truncates(host: Host, item_id: str, audio_end_ms: int) -> None:
    """``conversation.item.truncate``, handled (its handler returned: the binding handles one
    event at a time, so an event sent after it is handled once it is)."""
    before = host.types().count("conversation.item.truncated")
    host.binding.receive(json.dumps({"type": "conversation.item.truncate", "item_id": item_id,
                                     "content_index": 0, "audio_end_ms": audio_end_ms}))
    host.binding.receive(json.dumps({"type": "conversation.item.retrieve", "item_id": item_id}))
    await host.until(lambda: host.types().count("conversation.item.truncated") > before
                     and host.types()[-1] == "conversation.item.retrieved")
    await asyncio.sleep(0)  # a conversation dropped is closed by a task of its own


async def test_a_client_truncation_cuts_the_kept_state_to_the_tokens_its_text_keeps() -> None:
    """The client plays the audio and says, after the answer is done, that the user heard 1.5 s
    of it: the kept state is cut to the answer tokens voiced by then (the pipeline's cut of the
    ended request), the history keeps their text, and the next turn continues the same
    conversation over that history."""
    pipeline = ScriptedPipeline()
    host = await _answered_on_the_client(pipeline)
    first = pipeline.requests[0]
    answer = host.of("response.done")[0]["response"]["output"][0]["id"]
    await _client_truncates(host, answer, 1500)
    assert pipeline.aborted == [first.request_id] and pipeline.kept_on_abort == [9]
    await ask(host, pipeline, "And of Spain?")
    await host.until(lambda: len(pipeline.requests) == 2)
    second = pipeline.requests[1]
    assert second.params["conversation_id"] == first.params["conversation_id"]
    assert second.inputs["messages"][-2] == {**second.inputs["messages"][-2], "role": "assistant",
                                             "text": "".join(PIECES[:9])}
    assert pipeline.closed_conversations == []
    pipeline.push(text="Madrid.", text_tokens=1)
    pipeline.end()
    await host.until(lambda: host.types().count("response.done") == 2)
    # The first answer is no longer the kept state's last: cut again, the state cannot follow it.
    await _client_truncates(host, answer, 500)
    assert pipeline.aborted == [first.request_id]
    assert pipeline.closed_conversations == [first.params["conversation_id"]]
    await host.binding.end("test over")


async def test_a_client_truncation_the_kept_state_cannot_follow_drops_the_conversation() -> None:
    """Where the model does not count answer tokens, the truncated text is no count of tokens to
    keep: the conversation is dropped at once, and the next turn starts a new one (a full
    prefill over the truncated history)."""
    pipeline = ScriptedPipeline()
    host = await _answered_on_the_client(pipeline, counted=False)
    first = pipeline.requests[0].params["conversation_id"]
    answer = host.of("response.done")[0]["response"]["output"][0]["id"]
    await _client_truncates(host, answer, 1500)
    assert pipeline.aborted == [] and pipeline.closed_conversations == [first]
    await ask(host, pipeline, "And of Spain?")
    await host.until(lambda: len(pipeline.requests) == 2)
    second = pipeline.requests[1]
    assert second.params["conversation_id"] != first
    assert second.inputs["messages"][-2]["text"] == host.session.history.get(answer).transcript
    pipeline.end()
    await host.binding.end("test over")


async def test_a_client_truncation_of_the_answer_in_flight_starts_the_next_turn_afresh() -> None:
    """A truncation while its answer is still being generated: the request goes on (and will keep
    its whole turn), so nothing can be cut now; the next turn starts a new conversation."""
    pipeline = ScriptedPipeline()
    host = Host(pipeline, keep_model_state=True)
    host.session.audio = ClientPlayout()
    host.session.audio.listener = host.session
    await ask(host, pipeline)
    first = pipeline.requests[0].params["conversation_id"]
    for piece in PIECES:
        pipeline.push(text=piece, text_tokens=1)
    for tokens in (4, 9, 15):
        pipeline.push(audio=tone(1.0), sample_rate=RATE, answer_tokens=tokens)
    await host.until(lambda: host.types().count("response.output_audio.delta") == 3)
    await _client_truncates(host, host.session.response.item.id, 1500)
    pipeline.end()
    await host.until(lambda: "response.done" in host.types())
    assert pipeline.aborted == [] and pipeline.closed_conversations == []
    await ask(host, pipeline, "And of Spain?")
    await host.until(lambda: len(pipeline.requests) == 2)
    assert pipeline.requests[1].params["conversation_id"] != first
    await host.until(lambda: pipeline.closed_conversations == [first])
    pipeline.end()
    await host.binding.end("test over")
