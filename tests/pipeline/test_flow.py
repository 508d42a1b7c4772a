"""Requests flow through the pipeline in both runners: every terminal completes, fan-in waits for
all of its sources, each stream keeps its order, and the pipeline_* metrics follow the state."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
from prometheus_client import REGISTRY, generate_latest

from pipeline.coordinator import Coordinator
from pipeline.models.toy.graphs import relay_chain
from tests.pipeline.helpers import (
    audio_turn,
    collect,
    expected_audio,
    expected_text,
    make_request,
    running,
    toy_config,
    turn,
    wait_clear,
)

TOY = toy_config()
ANSWER = int(TOY.stage("thinker").options["answer_tokens"])
CHAIN = relay_chain(5, processes=2)


@pytest.fixture(scope="module")
async def chain(mode: str) -> AsyncIterator[Coordinator]:
    async with running(CHAIN, mode) as coordinator:
        yield coordinator


async def test_text_and_audio_terminals_both_complete_in_order(toy: Coordinator) -> None:
    request = make_request(turn("what is the weather like"))
    outcome = await collect(toy, request)

    assert sorted(outcome.finals) == ["code2wav", "decode"]
    for stage in ("decode", "code2wav"):
        flags = [c.final for c in outcome.chunks if c.stage == stage]
        assert flags[-1] and not any(flags[:-1]), f"{stage}: the final chunk must come last"
    assert outcome.text == expected_text(request.inputs, ANSWER)
    # The streamed waveform is the one-shot decode of the whole answer: no chunk lost or reordered.
    np.testing.assert_allclose(outcome.audio, expected_audio(TOY, request.inputs, ANSWER), atol=1e-6)
    rates = {c.data["sample_rate"] for c in outcome.chunks if "audio" in c.data}
    assert rates == {toy.output_sample_rate}
    await wait_clear(toy)


async def test_audio_input_rides_shared_memory_and_is_released(toy: Coordinator) -> None:
    request = make_request(audio_turn(48000), toy_answer_tokens=3)
    outcome = await collect(toy, request)
    assert outcome.text == expected_text(request.inputs, 3)
    await wait_clear(toy)


async def test_concurrent_requests_each_keep_their_own_stream(toy: Coordinator) -> None:
    requests = [
        make_request(turn(f"question number {i}"), toy_answer_tokens=1 + i % 5) for i in range(12)
    ]
    outcomes = await asyncio.gather(*(collect(toy, r) for r in requests))
    for request, outcome in zip(requests, outcomes, strict=True):
        n = request.params["toy_answer_tokens"]
        assert outcome.text == expected_text(request.inputs, n)
        np.testing.assert_allclose(outcome.audio, expected_audio(TOY, request.inputs, n), atol=1e-6)
    await wait_clear(toy)


async def test_fan_in_waits_for_every_source(fan_in: Coordinator) -> None:
    requests = [make_request(turn(f"fan {i}"), toy_answer_tokens=1 + i) for i in range(6)]
    outcomes = await asyncio.gather(*(collect(fan_in, r) for r in requests))
    for request, outcome in zip(requests, outcomes, strict=True):
        (chunk,) = outcome.chunks
        assert chunk.final and chunk.stage == "tail"
        assert chunk.data["joined_from"] == ["a", "b"]
        # From a: the relayed input; from b: the thinker's final count, which takes several steps.
        assert chunk.data["via_a"] and chunk.data["messages"] == request.inputs["messages"]
        assert chunk.data["tokens"] == request.params["toy_answer_tokens"]
        assert all(chunk.data[f"via_{s}"] for s in ("split", "join", "tail"))
    await wait_clear(fan_in)


async def test_relay_chain_passes_every_stage(chain: Coordinator) -> None:
    requests = [make_request(turn(f"hop {i}")) for i in range(8)]
    outcomes = await asyncio.gather(*(collect(chain, r) for r in requests))
    for request, outcome in zip(requests, outcomes, strict=True):
        (chunk,) = outcome.chunks
        assert chunk.final and chunk.stage == "r4"
        assert chunk.data["messages"] == request.inputs["messages"]
        assert all(chunk.data[f"via_r{i}"] for i in range(5))
    await wait_clear(chain)


def _metric(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def test_metrics_follow_live_state_and_return_to_zero(toy: Coordinator) -> None:
    stages = [s.name for s in TOY.stages]
    aborts_before = _metric("pipeline_abort_clear_seconds_count") or 0.0
    steps_before = _metric("pipeline_stage_seconds_count", stage="thinker") or 0.0

    stream = toy.stream(make_request(toy_never_stop=True))
    await anext(stream)  # the request now holds state in the thinker at least
    await toy.stage_stats()
    assert _metric("pipeline_stage_live_requests", stage="thinker") == 1
    assert _metric("pipeline_requests_active") == 1
    await stream.aclose()  # leaving early aborts
    await wait_clear(toy)

    text = generate_latest().decode()
    for stage in stages:
        for name in ("pipeline_stage_live_requests", "pipeline_stage_queue_depth"):
            assert f'{name}{{stage="{stage}"}} 0.0' in text
    for name in ("pipeline_requests_active", "pipeline_shm_bytes"):
        assert f"{name} 0.0" in text.splitlines()
    assert (_metric("pipeline_abort_clear_seconds_count") or 0.0) == aborts_before + 1
    assert (_metric("pipeline_stage_seconds_count", stage="thinker") or 0.0) > steps_before
