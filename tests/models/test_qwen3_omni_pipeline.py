"""The tiny Qwen3-Omni preset served end to end by ``start_pipeline``, in one process and as stage
processes: concurrent requests stream exactly what ``generate`` gives each alone, aborts at any
point leave no stage holding anything (and the requests beside them exact), bad input fails its
request with a clear error, and text-only requests skip the talker.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import numpy as np
import pytest
import torch

from harness.speech import speech
from harness.wer import wer
from pipeline.coordinator import Coordinator, PipelineError
from pipeline.models import StageContext
from pipeline.models.qwen3_omni.preprocess import Preprocessor
from pipeline.models.qwen3_omni.reference import ReferenceOutput
from pipeline.proto import OmniRequest, OutputChunk
from tests.models.cases import four_requests, reference_for, rel_l2, user
from tests.models.conftest import tiny_config
from tests.pipeline.helpers import assert_no_live_state, collect, running, wait_clear

CONFIG = tiny_config()
_round = iter(range(1_000_000))


def fresh(request: OmniRequest) -> OmniRequest:
    """The same request under an id never used before (ids cannot be reused, even after an end)."""
    return OmniRequest(f"{request.request_id}-{next(_round)}", request.inputs, dict(request.params))


@pytest.fixture(scope="module", params=["inproc", "process"])
async def coordinator(request: pytest.FixtureRequest) -> AsyncIterator[Coordinator]:
    async with running(CONFIG, request.param) as started:
        yield started


@pytest.fixture(scope="module")
def preprocessor() -> Preprocessor:
    return Preprocessor(StageContext(CONFIG.stage("preprocessing"), CONFIG.model_args))


@pytest.fixture(scope="module")
def references(reference_model, preprocessor: Preprocessor) -> dict[str, ReferenceOutput]:
    return {r.request_id: reference_for(reference_model, preprocessor, r, CONFIG) for r in four_requests()}


def with_voice(request: OmniRequest, voice: str) -> OmniRequest:
    return OmniRequest(request.request_id, request.inputs, {**request.params, "voice": voice})


@pytest.fixture(scope="module")
def chelsie(reference_model, preprocessor: Preprocessor) -> ReferenceOutput:
    return reference_for(reference_model, preprocessor, with_voice(four_requests()[0], "chelsie"), CONFIG)


def base_id(request: OmniRequest) -> str:
    return request.request_id.rsplit("-", 1)[0]


def assert_equals_reference(chunks: list[OutputChunk], ref: ReferenceOutput) -> None:
    tokens = [t for c in chunks for t in c.data.get("token_ids", [])]
    assert tokens == ref.tokens
    audio = np.concatenate([c.data["audio"] for c in chunks if "audio" in c.data])
    assert audio.shape == ref.waveform.shape
    assert rel_l2(audio, ref.waveform) <= 1e-4
    assert sorted(c.stage for c in chunks if c.final) == ["code2wav", "decode", "transcribe"]


async def chunks_until(stream: AsyncIterator[OutputChunk], key: str, count: int) -> list[OutputChunk]:
    """Chunks of ``stream`` up to the ``count``-th that carries ``key`` (or the stream's end)."""
    chunks: list[OutputChunk] = []
    async with asyncio.timeout(30):
        async for chunk in stream:
            chunks.append(chunk)
            if sum(key in c.data for c in chunks) >= count:
                break
    return chunks


async def abort_and_check(coordinator: Coordinator, request_id: str) -> None:
    """Acknowledged means cleared: once abort returns, no stage holds the request."""
    await asyncio.wait_for(coordinator.abort(request_id), 10)
    assert_no_live_state(await coordinator.stage_stats())


async def test_concurrent_requests_equal_generate(
    coordinator: Coordinator, references: dict[str, ReferenceOutput]
) -> None:
    requests = [fresh(r) for r in four_requests()]
    outcomes = await asyncio.gather(*(collect(coordinator, r, timeout=120) for r in requests))
    for request, outcome in zip(requests, outcomes):
        assert_equals_reference(outcome.chunks, references[base_id(request)])
    await wait_clear(coordinator)


async def test_abort_one_of_four_keeps_the_others_exact(
    coordinator: Coordinator, references: dict[str, ReferenceOutput]
) -> None:
    rng = random.Random(3)
    requests = [fresh(r) for r in four_requests()]
    victim = rng.choice(requests)
    others = [r for r in requests if r is not victim]
    running_others = [asyncio.create_task(collect(coordinator, r, timeout=120)) for r in others]
    stream = coordinator.stream(victim)
    await chunks_until(stream, rng.choice(["text", "audio"]), rng.randint(1, 3))
    await asyncio.wait_for(coordinator.abort(victim.request_id), 10)
    await stream.aclose()
    for request, outcome in zip(others, await asyncio.gather(*running_others)):
        assert_equals_reference(outcome.chunks, references[base_id(request)])
    await wait_clear(coordinator)


async def test_aborts_at_random_points_clear_every_stage(
    coordinator: Coordinator, references: dict[str, ReferenceOutput]
) -> None:
    """Mid-thinker (first text deltas), mid-talker (first audio) and mid-code2wav (later audio, the
    vocoder holding state) at seeded random chunk counts."""
    rng = random.Random(11)
    points = [("text", 1), ("audio", 1)] + [
        (rng.choice(["text", "audio"]), rng.randint(1, 6)) for _ in range(4)
    ]
    for key, count in points:
        request = fresh(rng.choice(four_requests()))
        stream = coordinator.stream(request)
        await chunks_until(stream, key, count)
        await abort_and_check(coordinator, request.request_id)
        await stream.aclose()
    await wait_clear(coordinator)
    request = fresh(four_requests()[0])
    assert_equals_reference((await collect(coordinator, request)).chunks, references[base_id(request)])


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "the last message must be a user turn"),
        ([user(audio=np.zeros(16000, np.float32), rate=4000)], "sample_rate 4000 is not supported"),
    ],
)
async def test_bad_input_fails_its_request_clearly(
    coordinator: Coordinator, messages: list, error: str
) -> None:
    with pytest.raises(PipelineError, match=error) as failure:
        await collect(coordinator, OmniRequest(f"bad-{next(_round)}", {"messages": messages}))
    assert failure.value.stage == "preprocessing"
    await wait_clear(coordinator)


async def test_text_only_requests_skip_the_talker(
    coordinator: Coordinator, references: dict[str, ReferenceOutput]
) -> None:
    request = fresh(four_requests()[2])
    request.params["modalities"] = ["text"]
    outcome = await collect(coordinator, request)
    tokens = [t for c in outcome.chunks for t in c.data.get("token_ids", [])]
    assert tokens == references[base_id(request)].tokens
    assert outcome.audio.size == 0
    assert sorted(outcome.finals) == ["code2wav", "decode", "transcribe"]
    await wait_clear(coordinator)


async def test_an_answer_after_an_assistant_message_equals_generate(
    coordinator: Coordinator, reference_model, preprocessor: Preprocessor
) -> None:
    """A Realtime client's response.create after an answer: another assistant turn, text only in."""
    assistant = {"role": "assistant", "text": "Hello! How can I help?", "audio": None, "sample_rate": None}
    request = OmniRequest(f"after-assistant-{next(_round)}", {"messages": [user(text="Hi there."), assistant]})
    outcome = await collect(coordinator, request)
    assert_equals_reference(outcome.chunks, reference_for(reference_model, preprocessor, request, CONFIG))
    await wait_clear(coordinator)


async def test_voices(
    coordinator: Coordinator, references: dict[str, ReferenceOutput], chelsie: ReferenceOutput
) -> None:
    """``default`` is the talker stage's voice (ethan here); another speaker changes the audio,
    not the text, exactly as generate's ``speaker`` does."""
    request = four_requests()[0]
    default = await collect(coordinator, fresh(with_voice(request, "default")))
    assert_equals_reference(default.chunks, references["audio16k"])
    other = await collect(coordinator, fresh(with_voice(request, "Chelsie")))
    assert_equals_reference(other.chunks, chelsie)
    assert chelsie.tokens == references["audio16k"].tokens
    assert not torch.equal(chelsie.codes, references["audio16k"].codes)


async def test_the_transcribe_stage_writes_down_the_turn_only_when_asked(coordinator: Coordinator) -> None:
    """Qwen3-Omni hears the user without writing it down: Whisper tiny.en beside the thinker
    does, for requests that ask (a session with input transcription or semantic_vad)."""
    said = "What time does the store open tomorrow?"
    messages = {"messages": [user(audio=speech(said), rate=16000)]}
    asked = await collect(coordinator, OmniRequest(f"transcribed-{next(_round)}", messages,
                                                   {"transcribe": True, "max_output_tokens": 2}))
    (transcript,) = [c.data["input_transcript"] for c in asked.chunks if "input_transcript" in c.data]
    assert wer(said, transcript) <= 0.2, transcript
    plain = await collect(coordinator, OmniRequest(f"untranscribed-{next(_round)}", messages,
                                                   {"max_output_tokens": 2}))
    assert not [c for c in plain.chunks if "input_transcript" in c.data]
    assert sorted(plain.finals) == ["code2wav", "decode", "transcribe"]
    await wait_clear(coordinator)
