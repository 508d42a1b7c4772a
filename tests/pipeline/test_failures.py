"""What goes wrong stays contained: output caps end stages that never stop, a stage that raises
fails only its request, overload is refused at once, and a dead or unloadable stage gives a clear
PipelineError instead of a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pipeline.config import parse_pipeline_config
from pipeline.coordinator import Coordinator, PipelineError, PipelineOverloaded
from pipeline.models.toy.runners import FRAME_SAMPLES
from pipeline.runner import start_pipeline
from tests.pipeline.helpers import (
    collect,
    expected_text,
    make_request,
    own_segments,
    running,
    toy_config,
    turn,
    wait_clear,
)

TOY = toy_config()
ANSWER = int(TOY.stage("thinker").options["answer_tokens"])
THINKER_CAP = TOY.stage("thinker").max_new_tokens
CAP_PARAM = TOY.stage("thinker").cap_param
FRAMES_PER_TOKEN = int(TOY.stage("talker").options["frames_per_token"])


async def assert_serves(coordinator: Coordinator) -> None:
    request = make_request(turn("still there"))
    outcome = await collect(coordinator, request)
    assert outcome.text == expected_text(request.inputs, ANSWER)
    await wait_clear(coordinator)


async def test_thinker_that_never_stops_is_capped_by_max_new_tokens(toy: Coordinator) -> None:
    request = make_request(toy_never_stop=True)
    outcome = await collect(toy, request)
    assert sorted(outcome.finals) == ["code2wav", "decode"]
    assert outcome.text == expected_text(request.inputs, THINKER_CAP)
    await wait_clear(toy)


async def test_the_request_cap_param_lowers_the_thinker_cap(toy: Coordinator) -> None:
    request = make_request(toy_never_stop=True, **{CAP_PARAM: 5})
    outcome = await collect(toy, request)
    assert outcome.text == expected_text(request.inputs, 5)
    await wait_clear(toy)


async def test_talker_that_never_stops_is_capped_by_the_text_it_speaks(toy: Coordinator) -> None:
    tokens = 4
    request = make_request(toy_never_stop=True, **{CAP_PARAM: tokens})
    outcome = await collect(toy, request)
    assert sorted(outcome.finals) == ["code2wav", "decode"]
    frames, rest = divmod(len(outcome.audio), FRAME_SAMPLES)
    assert rest == 0
    # Without its cap the talker would voice frames for as long as it runs.
    assert 1 <= frames <= tokens * FRAMES_PER_TOKEN + 1
    await wait_clear(toy)


@pytest.mark.parametrize("stage", [s.name for s in TOY.stages])
async def test_a_stage_that_raises_fails_only_its_request(toy: Coordinator, stage: str) -> None:
    good = [make_request(turn(f"fine {i}")) for i in range(3)]
    bad = make_request(turn("doomed"), toy_fail=stage)
    results = await asyncio.gather(
        collect(toy, bad), *(collect(toy, r) for r in good), return_exceptions=True
    )
    error = results[0]
    assert isinstance(error, PipelineError), error
    assert error.stage == stage and f"injected failure in stage {stage}" in str(error)
    for request, outcome in zip(good, results[1:], strict=True):
        assert not isinstance(outcome, BaseException), outcome
        assert outcome.text == expected_text(request.inputs, ANSWER)
    await wait_clear(toy)
    await assert_serves(toy)


async def test_beyond_max_in_flight_is_refused_at_once(toy: Coordinator) -> None:
    streams = [toy.stream(make_request(turn(f"load {i}"))) for i in range(TOY.max_in_flight)]
    for stream in streams:
        await asyncio.wait_for(anext(stream), 20)  # a stream holds its slot until it is closed
    assert toy.requests_in_flight == TOY.max_in_flight
    with pytest.raises(PipelineOverloaded, match="max_in_flight"):
        await asyncio.wait_for(collect(toy, make_request()), 1)
    for stream in streams:
        await stream.aclose()
    await wait_clear(toy)
    await assert_serves(toy)


async def test_a_stage_that_fails_to_load_makes_start_fail(mode: str) -> None:
    config = parse_pipeline_config(
        {
            "model": "toy",
            "entry": "relay",
            "stages": [
                {"name": "relay", "runner": "relay", "scheduler": "simple", "next": ["voice"]},
                {
                    "name": "voice",
                    "runner": "vocoder",
                    "scheduler": "vocoder",
                    "terminal": True,
                    "options": {"fail_to_load": True},
                },
            ],
        }
    )
    with pytest.raises(PipelineError, match="injected load failure") as failure:
        await asyncio.wait_for(start_pipeline(config, mode=mode, ready_timeout=60), 90)
    assert failure.value.stage == "voice"
    assert own_segments([]) == []


async def test_a_killed_stage_process_fails_requests_with_a_clear_error() -> None:
    async with running(TOY, "process") as coordinator:
        request = make_request(toy_never_stop=True)
        stream = coordinator.stream(request)
        await asyncio.wait_for(anext(stream), 20)
        os.kill(coordinator.stage_pids["thinker"], signal.SIGKILL)
        with pytest.raises(PipelineError, match="exited") as failure:
            async with asyncio.timeout(20):
                async for _ in stream:
                    pass
        assert failure.value.stage in {"thinker", "decode"}  # the stages of the killed process
        assert not coordinator.ready
        with pytest.raises(PipelineError, match="crashed"):
            await asyncio.wait_for(collect(coordinator, make_request()), 5)
        await asyncio.wait_for(coordinator.abort(request.request_id), 5)
        stats = await coordinator.stage_stats()
        assert set(stats) == {"talker", "code2wav"}  # the live stages still answer
        # The runner restarts the dead process; once its stages are Ready the pipeline serves.
        dead = coordinator.stage_pids["thinker"]
        async with asyncio.timeout(60):
            while not coordinator.ready:
                await asyncio.sleep(0.05)  # readiness arrives as a message; nothing to await on
        assert coordinator.stage_pids["thinker"] != dead
        answer = await collect(coordinator, make_request(), timeout=20)
        assert answer.text and len(answer.audio) and sorted(answer.finals) == ["code2wav", "decode"]
        stats = await coordinator.stage_stats()
        assert set(stats) == {"thinker", "decode", "talker", "code2wav"}
        assert all(s.live_requests == 0 for s in stats.values()), stats


async def test_a_crash_clears_the_request_from_the_surviving_stages() -> None:
    """The talker's process dies while the thinker (another process) is 20 s from its cap: the
    crash fails the request and clears it from the thinker at once, with nobody calling abort."""
    slow = toy_config({"thinker": {"step_delay_s": 0.05}}, max_in_flight=4)
    slow = slow.model_copy(update={"stages": [
        s.model_copy(update={"max_new_tokens": 400}) if s.name == "thinker" else s for s in slow.stages]})
    async with running(slow, "process") as coordinator:
        stream = coordinator.stream(make_request(toy_never_stop=True))
        await asyncio.wait_for(anext(stream), 20)
        assert (await coordinator.stage_stats())["thinker"].live_requests == 1
        os.kill(coordinator.stage_pids["talker"], signal.SIGKILL)
        with pytest.raises(PipelineError, match="exited"):
            async with asyncio.timeout(20):
                async for _ in stream:
                    pass
        async with asyncio.timeout(5):
            while (await coordinator.stage_stats())["thinker"].live_requests:
                await asyncio.sleep(0.05)


@pytest.mark.parametrize("mode", ["inproc", "process"])
async def test_a_stalled_stage_fails_the_stream_and_is_cleared_everywhere(mode: str) -> None:
    """A thinker step that takes 3 s (a hung kernel, a deadlock) against a 0.5 s idle timeout: the
    stream fails with a clear error instead of hanging, and the abort leaves no stage holding it."""
    stalled = toy_config({"thinker": {"step_delay_s": 3.0}}, stream_idle_timeout_s=0.5)
    async with running(stalled, mode) as coordinator:
        began = time.monotonic()
        with pytest.raises(PipelineError, match=r"no output for 0.5 s"):
            await collect(coordinator, make_request(turn("are you there")))
        # The stream gives up at 0.5 s and raises once every stage acknowledged the abort: the
        # thinker only after its 3 s step, so it held the request (a stage that did not would
        # have acknowledged at once). Load can only lengthen this, never shorten it.
        assert time.monotonic() - began >= 3.0
        await wait_clear(coordinator)
        assert coordinator.requests_in_flight == 0
