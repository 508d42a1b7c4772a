"""The offline model set (configs/offline.yaml) served by ``start_pipeline`` as stage processes:
spoken questions are recognised, answered correctly and spoken back; the agent's audio says what its
text says; ``spoken_text`` covers the answer exactly; an abort mid-answer clears every stage.

One pipeline for the module (models load once); the language model is converted beforehand, so
that a first run's one-time conversion does not count against the pipeline's start timeout.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("faster_whisper")
pytest.importorskip("piper")

from harness.speech import speech
from harness.wer import normalize, wer
from pipeline.config import parse_pipeline_config, read_yaml
from pipeline.coordinator import Coordinator
from pipeline.models.offline.asr import Transcriber
from pipeline.models.offline.sources import lm_source, prepare_lm
from pipeline.proto import OmniRequest, OutputChunk
from tests.pipeline.helpers import assert_no_live_state, collect, running, wait_clear

PRESET = Path(__file__).resolve().parents[2] / "configs" / "offline.yaml"
CONFIG = parse_pipeline_config(read_yaml(PRESET)["pipeline"])
RATE = 16000
_ids = itertools.count()


def spoken(question: str, **params: object) -> OmniRequest:
    """A request whose last (only) message is ``question`` as espeak speech."""
    message = {"role": "user", "text": None, "audio": speech(question, RATE), "sample_rate": RATE}
    return OmniRequest(f"offline-{next(_ids)}", {"messages": [message]}, dict(params))


def texts(chunks: list[OutputChunk], key: str) -> str:
    return "".join(c.data[key] for c in chunks if key in c.data)


@pytest.fixture(scope="module")
async def coordinator() -> AsyncIterator[Coordinator]:
    await asyncio.to_thread(prepare_lm, lm_source("packaged"))
    async with running(CONFIG, "process") as started:
        yield started


async def test_spoken_question_is_transcribed_before_the_answer(coordinator: Coordinator) -> None:
    question = "What is the capital of Japan?"
    chunks = (await collect(coordinator, spoken(question, modalities=["text"]), timeout=60)).chunks
    carrying = [i for i, c in enumerate(chunks) if "input_transcript" in c.data]
    assert len(carrying) == 1 and chunks[carrying[0]].stage == "judge"
    first_text = next(i for i, c in enumerate(chunks) if c.data.get("text"))
    assert carrying[0] < first_text
    assert wer(question, chunks[carrying[0]].data["input_transcript"]) <= 0.2
    assert "tokyo" in normalize(texts(chunks, "text"))
    assert not any("audio" in c.data for c in chunks)  # text only: the tts stage did nothing


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        # Not "... capital of France?": Whisper tiny.en hears espeak's "of France" as "and France"
        # or "and friends" on some runs, and the model then names another capital.
        ("What is the capital of Japan?", "tokyo"),
        ("How many legs does a spider have?", "8"),
        ("What is frozen water called?", "ice"),
    ],
)
async def test_questions_get_their_right_answer(
    coordinator: Coordinator, question: str, answer: str
) -> None:
    chunks = (await collect(coordinator, spoken(question, modalities=["text"]), timeout=60)).chunks
    assert answer in normalize(texts(chunks, "text")), texts(chunks, "text")


async def test_a_typed_turn_in_a_conversation_is_answered_without_transcript(
    coordinator: Coordinator,
) -> None:
    messages = [
        {"role": "system", "text": "You are a helpful assistant. Answer in one short sentence."},
        {"role": "user", "text": "Hello!"},
        {"role": "assistant", "text": "Hello! How can I help you today?"},
        {"role": "user", "text": "What is the capital of France?"},
    ]
    request = OmniRequest(f"offline-{next(_ids)}", {"messages": messages}, {"modalities": ["text"]})
    chunks = (await collect(coordinator, request, timeout=60)).chunks
    assert not any("input_transcript" in c.data for c in chunks)
    assert "paris" in normalize(texts(chunks, "text"))


async def test_concurrent_requests_are_answered_in_turn(coordinator: Coordinator) -> None:
    """Concurrent requests are all answered (the decoder serves up to max_batch side by side,
    spoken answers starting one after another): none is lost."""
    questions = {"What is the capital of Japan?": "tokyo", "What is frozen water called?": "ice"}
    outcomes = await asyncio.gather(
        *(collect(coordinator, spoken(q, modalities=["text"]), timeout=90) for q in questions)
    )
    for answer, outcome in zip(questions.values(), outcomes):
        assert answer in normalize(texts(outcome.chunks, "text"))
    await wait_clear(coordinator)


async def test_the_agent_says_what_it_writes(
    coordinator: Coordinator, transcriber: Transcriber
) -> None:
    request = spoken("What color is the sky on a clear day?", modalities=["text", "audio"])
    chunks = (await collect(coordinator, request, timeout=90)).chunks
    text = texts(chunks, "text")
    voiced = [c for c in chunks if "audio" in c.data]
    assert len(voiced) >= 1 and {c.data["sample_rate"] for c in voiced} == {22050}
    # spoken_text chunks partition the answer: the session truncates to them exactly.
    assert "".join(c.data["spoken_text"] for c in voiced).split() == text.split()
    audio = np.concatenate([c.data["audio"] for c in voiced])
    assert 0.02 < float(np.sqrt(np.mean(audio**2))) < 0.5
    heard = await asyncio.to_thread(transcriber.transcribe, audio, 22050)
    assert wer(text, heard) <= 0.35, (text, heard)


async def test_abort_mid_answer_clears_every_stage(coordinator: Coordinator) -> None:
    request = spoken("Tell me a long story about a brave little dragon.", max_output_tokens=96)
    stream = coordinator.stream(request)
    async with asyncio.timeout(60):
        async for chunk in stream:
            if "audio" in chunk.data:
                break
    # Both the decoder and the synthesis are still at work on this answer when it is aborted.
    live = {name: s.live_requests for name, s in (await coordinator.stage_stats()).items()}
    assert live["lm"] == 1 and live["tts"] == 1, live
    await asyncio.wait_for(coordinator.abort(request.request_id), 10)
    await stream.aclose()
    assert_no_live_state(await coordinator.stage_stats())
    chunks = (
        await collect(
            coordinator, spoken("What is the capital of Japan?", modalities=["text"]), 60
        )
    ).chunks
    assert "tokyo" in normalize(texts(chunks, "text"))
    await wait_clear(coordinator)


async def test_the_answer_does_not_wait_for_the_judgement_of_the_words(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A speculative request (``end_of_turn``): the words go to the LM and to the judge at once.
    Here the judge holds its judgement until the LM has written its first text (inproc: the stages
    are threads of this process), so a judge on the LM's path would hold the answer instead."""
    import threading

    from pipeline.models.offline.finished_text import FinishedText
    from pipeline.models.offline.lm import LanguageModel

    answered = threading.Event()
    step_one, probability = LanguageModel._step_one, FinishedText.probability

    def noting_text(self, slot):
        result = step_one(self, slot)
        if result.data and result.data.get("text"):
            answered.set()
        return result

    def after_the_answer(self, transcript, context=None):
        assert answered.wait(30), "the LM wrote nothing while the words were being judged"
        return probability(self, transcript, context)

    monkeypatch.setattr(LanguageModel, "_step_one", noting_text)
    monkeypatch.setattr(FinishedText, "probability", after_the_answer)
    await asyncio.to_thread(prepare_lm, lm_source("packaged"))
    async with running(CONFIG, "inproc") as coordinator:
        request = spoken("What is the capital of Japan?", modalities=["text"], end_of_turn=True)
        chunks = (await collect(coordinator, request, timeout=90)).chunks
    judged = [i for i, c in enumerate(chunks) if "input_end_of_turn" in c.data]
    first_text = next(i for i, c in enumerate(chunks) if c.data.get("text"))
    assert len(judged) == 1 and first_text < judged[0]
    assert 0.0 <= chunks[judged[0]].data["input_end_of_turn"] <= 1.0
    assert "tokyo" in normalize(texts(chunks, "text"))


async def test_a_line_the_session_gives_is_said_word_for_word(
    coordinator: Coordinator, transcriber: Transcriber
) -> None:
    """``params["say"]`` (a check-in, a closing line): the answer is those words, not the small
    model's own (asked in instructions to repeat a line, SmolLM2 repeated its last answer)."""
    line = "Are you still there? I can wait a little longer."
    history = [{"role": "user", "text": "What is the capital of Japan?"},
               {"role": "assistant", "text": "The capital of Japan is Tokyo."},
               {"role": "user", "text": "..."}]
    request = OmniRequest(f"offline-{next(_ids)}", {"messages": history},
                          {"modalities": ["text", "audio"], "say": line})
    chunks = (await collect(coordinator, request, timeout=60)).chunks
    assert texts(chunks, "text") == line
    audio = np.concatenate([c.data["audio"] for c in chunks if "audio" in c.data])
    heard = await asyncio.to_thread(transcriber.transcribe, audio, 22050)
    assert wer(line, heard) <= 0.2, heard
