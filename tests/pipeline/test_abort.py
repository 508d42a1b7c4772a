"""Abort at every point of a request's life, in both runners.

Whatever the moment, an abort returns once every stage acknowledged it, and from then on no stage
holds anything of the request (checked at once, not eventually); shared memory in transit drains to
zero, the id can never be used again, and the pipeline keeps serving.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

from pipeline.coordinator import Coordinator, PipelineError
from pipeline.proto import OmniRequest
from tests.pipeline.helpers import (
    assert_no_live_state,
    collect,
    expected_text,
    make_request,
    toy_config,
    turn,
    wait_clear,
    wait_until,
)

# A thinker that runs far ahead of a slow talker, with 64 KiB hidden states that ride shared
# memory: at any moment many chunks are in flight between them.
TOY = toy_config(
    {"thinker": {"step_delay_s": 0.001, "hidden_size": 16384}, "talker": {"step_delay_s": 0.005}}
)
ANSWER = int(TOY.stage("thinker").options["answer_tokens"])


async def abort_now(coordinator: Coordinator, request_id: str) -> None:
    """Abort and check that acknowledged means cleared: no stage holds the request any more."""
    await asyncio.wait_for(coordinator.abort(request_id), 5)
    assert_no_live_state(await coordinator.stage_stats())


async def assert_serves(coordinator: Coordinator) -> None:
    """A later request completes with the whole, correct answer; then everything drains."""
    request = make_request(turn("are you still there"), toy_answer_tokens=3)
    outcome = await collect(coordinator, request)
    if coordinator.config.entry == "thinker":
        assert sorted(outcome.finals) == ["code2wav", "decode"]
        assert outcome.text == expected_text(request.inputs, 3)
    else:
        assert outcome.finals == ["tail"] and outcome.chunks[0].data["tokens"] == 3
    await wait_clear(coordinator)


async def first_chunk_with(stream: AsyncIterator, key: str) -> list:
    chunks = []
    async with asyncio.timeout(20):
        while not chunks or key not in chunks[-1].data:
            chunks.append(await anext(stream))
    return chunks


async def drain(stream: AsyncIterator) -> list:
    async with asyncio.timeout(20):
        return [chunk async for chunk in stream]


async def test_abort_of_an_id_never_submitted_is_acknowledged_and_burns_it(toy: Coordinator) -> None:
    await abort_now(toy, "req-never-submitted")
    with pytest.raises(ValueError, match="already used"):
        await collect(toy, OmniRequest("req-never-submitted", turn("hello")))
    # Also while that abort is still on its way to the stages.
    aborting = asyncio.create_task(toy.abort("req-aborting"))
    await asyncio.sleep(0)  # one loop step: the abort has been broadcast, not yet acknowledged
    with pytest.raises(ValueError, match="already used"):
        await collect(toy, OmniRequest("req-aborting", turn("hello")))
    await asyncio.wait_for(aborting, 5)
    await assert_serves(toy)


async def test_abort_before_the_entry_stage_has_the_request(toy: Coordinator) -> None:
    request = make_request()
    stream = toy.stream(request)
    first = asyncio.ensure_future(anext(stream))
    async with asyncio.timeout(5):
        while toy.requests_in_flight == 0:  # the submit has just been sent to the entry stage
            await asyncio.sleep(0)
    await abort_now(toy, request.request_id)
    with pytest.raises(StopAsyncIteration):  # an aborted stream ends quietly
        await asyncio.wait_for(first, 5)
    await wait_clear(toy)
    with pytest.raises(ValueError, match="already used"):
        await collect(toy, request)
    await assert_serves(toy)


async def test_abort_during_fan_in(fan_in: Coordinator) -> None:
    request = make_request(toy_never_stop=True)  # source b never finishes on its own
    consumer = asyncio.create_task(collect(fan_in, request))
    await wait_until(fan_in, lambda s: s["join"].live_requests == 1, "holding a's part in join")
    await abort_now(fan_in, request.request_id)
    assert (await consumer).chunks == []
    await wait_clear(fan_in)
    await assert_serves(fan_in)


async def test_a_failed_fan_in_source_clears_the_other_parts(fan_in: Coordinator) -> None:
    """A failure clears every stage like an abort: join must not keep a's part waiting for b."""
    for _ in range(5):
        with pytest.raises(PipelineError) as failure:
            await collect(fan_in, make_request(toy_fail="b"))
        assert failure.value.stage == "b"
    await wait_clear(fan_in)
    await assert_serves(fan_in)


async def test_abort_mid_stream_ends_the_stream(toy: Coordinator) -> None:
    request = make_request()
    stream = toy.stream(request)
    chunks = await first_chunk_with(stream, "audio")
    await abort_now(toy, request.request_id)
    chunks += await drain(stream)  # only what was delivered before the abort, then the end
    text = "".join(c.data.get("text", "") for c in chunks)
    assert expected_text(request.inputs, ANSWER).startswith(text)
    await wait_clear(toy)
    await assert_serves(toy)


@pytest.mark.parametrize("how", ["break", "aclose", "cancel", "cancel twice"])
async def test_leaving_the_stream_early_aborts(toy: Coordinator, how: str) -> None:
    request = make_request()
    if how == "break":
        async for chunk in toy.stream(request):
            if "audio" in chunk.data:
                break
    elif how == "aclose":
        stream = toy.stream(request)
        await first_chunk_with(stream, "audio")
        await asyncio.wait_for(stream.aclose(), 5)
    else:
        consumer = asyncio.create_task(collect(toy, request))
        await wait_until(toy, lambda s: s["talker"].live_requests == 1, "talking")
        consumer.cancel()
        if how == "cancel twice":  # the second lands while the first one's abort is awaited
            await asyncio.sleep(0)  # one loop step: the consumer now waits for the abort's acks
            consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
    await wait_clear(toy)  # and the flight is gone: it would count against max_in_flight
    await assert_serves(toy)


async def test_abort_after_completion_returns_at_once(toy: Coordinator) -> None:
    request = make_request()
    outcome = await collect(toy, request)
    assert outcome.text == expected_text(request.inputs, ANSWER)
    await abort_now(toy, request.request_id)
    await abort_now(toy, request.request_id)
    await wait_clear(toy)


async def test_abort_twice_concurrently_and_again(toy: Coordinator) -> None:
    request = make_request()
    stream = toy.stream(request)
    await first_chunk_with(stream, "text")
    await asyncio.wait_for(
        asyncio.gather(toy.abort(request.request_id), toy.abort(request.request_id)), 5
    )
    assert_no_live_state(await toy.stage_stats())
    await abort_now(toy, request.request_id)
    await drain(stream)
    await wait_clear(toy)
    await assert_serves(toy)


async def test_abort_while_late_data_is_in_flight(toy: Coordinator) -> None:
    """The thinker is far ahead of the talker: hidden states are on their way when the abort
    lands; whatever arrives after a stage acknowledged is freed and never recreates state."""
    requests = [make_request(turn(f"in flight {i}")) for i in range(4)]
    streams = [toy.stream(r) for r in requests]
    for stream in streams:
        await first_chunk_with(stream, "text")
    await wait_until(toy, lambda s: s["talker"].live_requests == len(requests), "all talking")
    await asyncio.wait_for(asyncio.gather(*(toy.abort(r.request_id) for r in requests)), 5)
    assert_no_live_state(await toy.stage_stats())
    for stream in streams:
        await drain(stream)
    await wait_clear(toy)  # shared memory of the chunks in flight is back to zero
    await assert_serves(toy)


async def test_500_random_aborts_under_concurrency(toy: Coordinator) -> None:
    rng = random.Random(500)
    plans = [
        (
            make_request(turn(f"random {i}"), toy_answer_tokens=rng.randint(1, 4)),
            rng.choices(["abort", "cancel", "abort_first"], weights=[45, 45, 10])[0],
            rng.uniform(0.0, 0.15),
        )
        for i in range(500)
    ]
    limit = asyncio.Semaphore(24)
    ended: dict[str, int] = {"completed": 0, "cut": 0, "refused": 0}

    async def one(request: OmniRequest, how: str, delay: float) -> None:
        async with limit:
            if how == "abort_first":
                await toy.abort(request.request_id)
                with pytest.raises(ValueError):
                    await collect(toy, request)
                ended["refused"] += 1
                return
            consumer = asyncio.create_task(collect(toy, request))
            await asyncio.sleep(delay)  # the random moment of the abort (test input, not a wait)
            if how == "abort":
                await asyncio.wait_for(toy.abort(request.request_id), 5)
            else:
                consumer.cancel()
            try:
                outcome = await consumer
            except asyncio.CancelledError:
                ended["cut"] += 1
                return
        want = expected_text(request.inputs, request.params["toy_answer_tokens"])
        if sorted(outcome.finals) == ["code2wav", "decode"]:
            assert outcome.text == want
            ended["completed"] += 1
        else:
            assert want.startswith(outcome.text)
            ended["cut"] += 1

    await asyncio.wait_for(asyncio.gather(*(one(*plan) for plan in plans)), 120)
    assert sum(ended.values()) == 500 and ended["cut"] > 0, ended
    await wait_clear(toy)
    await assert_serves(toy)
