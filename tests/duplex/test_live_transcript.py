"""The user's turn transcribed while they speak (duplex/session/live_transcript.py), against a
pipeline fake whose recogniser answers each recognition request with a hypothesis of the audio it
got, with the real VAD and the real transport binding (``Host`` of the scripted session tests).

What it pins down: words go out only once two consecutive hypotheses agree on them, before the turn
ends, and with the final transcript's rest they make exactly the completed transcript; at most one
hypothesis is in flight, none once the turn ended; nothing is asked where the client did not ask
for transcripts or the pipeline does not transcribe.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from duplex.session.live_transcript import LocalAgreement
from harness.scripted_pipeline import ScriptedPipeline
from harness.speech import speech
from pipeline.proto import OmniRequest, OutputChunk
from tests.duplex.test_session_scripted import Host

SENTENCE = "What is the capital of France and how many people live there"
WORDS = SENTENCE.split()
PAD_S = 0.3
DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"


class Recogniser(ScriptedPipeline):
    """The scripted pipeline, whose recognition requests (transcribe, one output token) it answers
    itself: ``hypothesis`` of the seconds of audio heard, or no transcript at all where it is None
    (a pipeline that does not transcribe), or never where ``hang``. Other requests are scripted."""

    def __init__(self, hypothesis: Callable[[float], str] | None = None, hang: bool = False) -> None:
        super().__init__()
        self._hypothesis = hypothesis
        self._hang = hang
        self.heard: list[tuple[float, str]] = []  # (when, in events sent so far; the hypothesis)
        self.recognitions = 0
        self.live = 0  # recognition requests in flight
        self.most_live = 0
        self.events: list[dict[str, Any]] = []  # the Host's, to date each hypothesis

    async def stream(self, request: OmniRequest) -> AsyncIterator[OutputChunk]:
        params = request.params
        if not (params.get("transcribe") and params.get("max_output_tokens") == 1):
            async for chunk in super().stream(request):
                yield chunk
            return
        self.recognitions += 1
        self.live += 1
        self.most_live = max(self.most_live, self.live)
        try:
            if self._hang:
                await asyncio.Event().wait()  # until the session leaves the request
            seconds = len(request.inputs["messages"][-1]["audio"]) / 16000
            if self._hypothesis is not None:
                text = self._hypothesis(seconds)
                self.heard.append((len(self.events), text))
                yield OutputChunk(request.request_id, "asr", {"input_transcript": text})
            yield OutputChunk(request.request_id, "lm", {"text": "Hm"})
        finally:
            self.live -= 1


def growing(duration_s: float) -> Callable[[float], str]:
    """Hypotheses of SENTENCE spoken evenly over ``duration_s``: the words said so far, the last
    one still misheard (a different guess each time, as a recogniser guesses at a cut word)."""
    guesses = itertools.count()

    def hypothesis(seconds: float) -> str:
        said = min(len(WORDS), int(len(WORDS) * max(0.0, seconds - PAD_S) / duration_s))
        cut = [] if said == len(WORDS) else [WORDS[said][:2] + "-" * (1 + next(guesses) % 2)]
        return " ".join(WORDS[:said] + cut)

    return hypothesis


async def transcribed_host(pipeline: Recogniser, transcription: bool = True, answers: bool = True) -> Host:
    """A session on ``pipeline`` (server_vad), its client asking for transcripts where
    ``transcription``, and for no answers unless ``answers``."""
    host = Host(pipeline)
    pipeline.events = host.events
    audio_input: dict[str, Any] = {"turn_detection": {"type": "server_vad", "create_response": answers}}
    if transcription:
        audio_input["transcription"] = {"model": "whisper-1"}
    host.binding.receive(json.dumps({"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": audio_input}}}))
    await host.until(lambda: "session.updated" in host.types())
    return host


def spoken() -> tuple[Any, float]:
    audio = speech(SENTENCE, 16000, PAD_S, 0.0)
    return audio, len(audio) / 16000 - PAD_S


def agreed(first: str, second: str) -> list[str]:
    pairs = itertools.takewhile(lambda pair: pair[0] == pair[1], zip(first.split(), second.split()))
    return [word for word, _ in pairs]


async def answer_turn(host: Host, pipeline: Recogniser) -> None:
    await host.until(lambda: "response.created" in host.types())
    pipeline.push(input_transcript=SENTENCE)
    pipeline.push(text="Paris.")
    pipeline.end()
    await host.until(lambda: COMPLETED in host.types())


async def test_firmed_words_arrive_while_the_user_speaks_and_make_the_completed_transcript() -> None:
    audio, duration = spoken()
    pipeline = Recogniser(growing(duration))
    host = await transcribed_host(pipeline)
    await host.feed(audio)
    await host.silence(30)
    await answer_turn(host, pipeline)
    types = host.types()
    stopped = types.index("input_audio_buffer.speech_stopped")
    deltas = [(i, e) for i, e in enumerate(host.events) if e["type"] == DELTA]
    item_id = host.of("input_audio_buffer.committed")[0]["item_id"]
    assert item_id == host.of("input_audio_buffer.speech_started")[0]["item_id"]
    assert {e["item_id"] for _, e in deltas} == {item_id} == {host.of(COMPLETED)[0]["item_id"]}
    # Told while the user spoke: exactly the words the last two hypotheses agreed on.
    while_spoken = "".join(e["delta"] for i, e in deltas if i < stopped)
    hypotheses = [text for at, text in pipeline.heard if at < stopped]
    assert len(hypotheses) >= 3 and while_spoken
    assert while_spoken == " ".join(agreed(hypotheses[-2], hypotheses[-1]))
    # Each delta told words the two hypotheses before it agreed on, in order, never a guess.
    told = ""
    for index, event in (d for d in deltas if d[0] < stopped):
        told += event["delta"]
        before = [text for at, text in pipeline.heard if at <= index]
        assert told.split() == agreed(before[-2], before[-1]), (told, before[-2:])
    # The last words were not firm at the turn's end (one hypothesis heard them): the rest of the
    # final transcript is one more delta, just before the completed event.
    (rest,) = [(i, e) for i, e in deltas if i > stopped]
    assert rest[0] + 1 == types.index(COMPLETED) and rest[1]["delta"]
    assert "".join(e["delta"] for _, e in deltas) == host.of(COMPLETED)[0]["transcript"] == SENTENCE
    await host.binding.end("test over")
    assert pipeline.live == 0 and pipeline.most_live == 1


async def test_one_hypothesis_at_a_time_and_none_left_once_the_turn_or_the_session_ends() -> None:
    """A recogniser that never answers: one request for the whole turn, left when the client
    commits the turn (no VAD window after it to notice), or when the session ends mid-turn."""
    audio, _ = spoken()
    pipeline = Recogniser(hang=True)
    host = await transcribed_host(pipeline, answers=False)
    await host.feed(audio)
    assert pipeline.recognitions == 1 and pipeline.live == 1
    host.binding.receive(json.dumps({"type": "input_audio_buffer.commit"}))
    await host.until(lambda: "input_audio_buffer.committed" in host.types() and pipeline.live == 0)
    await host.feed(audio)
    assert pipeline.recognitions == 2 and pipeline.live == 1
    await host.binding.end("test over")
    assert pipeline.live == 0 and DELTA not in host.types()


async def test_nothing_is_transcribed_live_unless_asked_or_where_the_pipeline_cannot() -> None:
    audio, duration = spoken()
    unasked = Recogniser(growing(duration))
    host = await transcribed_host(unasked, transcription=False)
    await host.feed(audio)
    await host.silence(30)
    assert unasked.recognitions == 0
    await host.binding.end("test over")
    # A pipeline that answers a recognition without a transcript is asked once per session.
    mute = Recogniser()
    host = await transcribed_host(mute, answers=False)
    for _ in range(2):
        await host.feed(audio)
        await host.silence(30)
    assert host.types().count("input_audio_buffer.committed") == 2
    assert mute.recognitions == 1 and DELTA not in host.types()
    await host.binding.end("test over")


def test_a_firm_word_punctuated_anew_still_agrees() -> None:
    agreement = LocalAgreement()
    assert agreement.hear("Hello there") == []
    assert agreement.hear("Hello there, how") == ["Hello"]
    assert agreement.hear("Hello, there, how are") == []  # "Hello," is not "Hello" word for word
    assert agreement.hear("Hello, there, how are you") == ["there,", "how", "are"]
    assert agreement.hear("Goodbye there, how are you") == []
    # Two agree, but on other words where "Hello" was told: what was told cannot be extended.
    assert agreement.hear("Goodbye there, how are you now") == []
