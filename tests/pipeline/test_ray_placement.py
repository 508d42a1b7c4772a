"""Stages as Ray actors (``placement: ray``) on a multi-node cluster, the way Ray tests itself:
``ray.cluster_utils.Cluster`` starts a head and two worker nodes (raylets) on loopback, once for
the module. The toy pipeline answers across nodes exactly as in one process, two front ends
(coordinators) share one set of stage actors, an abort storm leaves nothing on any node, and a
node that disappears mid-answer fails its requests clearly while the restarted stages serve again.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster

from harness.ray_cluster import local_cluster
from pipeline.config import ConfigError, PipelineConfig, parse_pipeline_config
from pipeline.coordinator import Coordinator, PipelineError
from pipeline.placement.ray_actor import actor_name, actor_prefix
from pipeline.placement.ray_supervisor import describe_stages, remove_stages
from pipeline.runner import start_pipeline
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

NAMESPACE = "duplex-test"
# Tiny nodes: the head holds no stage (0 CPUs); each worker fits every stage (4 x 0.5 CPU), so the
# stages of a removed node can restart on the other one.
TOY = toy_config(max_in_flight=128)
ANSWER = int(TOY.stage("thinker").options["answer_tokens"])


def ray_config(base: PipelineConfig = TOY, **fields: Any) -> PipelineConfig:
    """``base`` placed on Ray: every stage an actor of half a CPU, spread over the nodes."""
    data = base.model_dump()
    for stage in data["stages"]:
        stage["num_cpus"] = 0.5
    placement = {"placement": "ray", "ray_namespace": NAMESPACE, "ray_spread": True}
    return parse_pipeline_config({**data, **placement, **fields})


SHARED = ray_config()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with local_cluster(NAMESPACE, cpus_per_worker=2, object_store_mib=80) as running:
        yield running


@pytest.fixture(scope="module")
async def front(cluster: Cluster) -> AsyncIterator[Coordinator]:
    """A front end on the shared stage actors (created by it, found by the others)."""
    async with running(SHARED, "process") as coordinator:
        yield coordinator
    remove_stages(SHARED)


async def placement(config: PipelineConfig) -> dict[str, dict[str, Any]]:
    """Stage -> where its actor runs now (asked of the actors themselves)."""
    return await describe_stages(config, 30)


async def answers(coordinator: Coordinator, inputs: list[dict[str, Any]]) -> list[Any]:
    return await asyncio.gather(*(collect(coordinator, make_request(i)) for i in inputs))


INPUTS = [turn("hello"), turn("across nodes"), audio_turn(4000), audio_turn(64000)]


def test_a_placement_group_needs_every_stage_to_reserve_something() -> None:
    data = TOY.model_dump()
    data["stages"][1]["num_cpus"] = 0
    with pytest.raises(ConfigError, match="stages.decode: with ray_placement_group"):
        parse_pipeline_config({**data, "placement": "ray", "ray_placement_group": "PACK"})


async def test_toy_answers_across_nodes_as_in_one_process(cluster: Cluster) -> None:
    config = ray_config(ray_placement_group="SPREAD", ray_spread=False)
    try:
        async with running(config, "process") as coordinator:
            where = await placement(config)
            assert len({info["node_id"] for info in where.values()}) == 2, where
            placed = await answers(coordinator, INPUTS)
            await wait_clear(coordinator)
    finally:
        remove_stages(config)
    async with running(TOY, "inproc") as coordinator:
        local = await answers(coordinator, INPUTS)
    for inputs, ray_outcome, local_outcome in zip(INPUTS, placed, local, strict=True):
        assert ray_outcome.text == local_outcome.text == expected_text(inputs, ANSWER)
        assert np.array_equal(ray_outcome.audio, local_outcome.audio)
        np.testing.assert_allclose(ray_outcome.audio, expected_audio(TOY, inputs, ANSWER), atol=1e-5)
        assert sorted(ray_outcome.finals) == ["code2wav", "decode"]


async def test_a_stage_that_fails_to_load_makes_start_fail_and_is_removed(cluster: Cluster) -> None:
    relay = {"runner": "relay", "scheduler": "simple"}
    voice = {"runner": "vocoder", "scheduler": "vocoder", "options": {"fail_to_load": True}}
    config = ray_config(parse_pipeline_config({
        "model": "toy",
        "entry": "relay",
        "stages": [
            {"name": "relay", **relay, "next": ["voice"]},
            {"name": "voice", **voice, "terminal": True},
        ],
    }))
    with pytest.raises(PipelineError, match="injected load failure") as failure:
        await asyncio.wait_for(start_pipeline(config, ready_timeout=60), 90)
    assert failure.value.stage == "voice"
    # Removed, not left broken under its name: the next front end starts it afresh.
    name = actor_name(actor_prefix(config), "voice")
    async with asyncio.timeout(10):
        while True:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            await asyncio.sleep(0.1)
    remove_stages(config)


async def test_two_front_ends_share_the_stage_actors(front: Coordinator) -> None:
    async with running(SHARED, "process") as second:
        # One actor per stage, found by name: both coordinators talk to the same incarnations.
        assert second.stage_pids == front.stage_pids
        inputs = [turn(f"front {i}") for i in range(6)]
        both = await asyncio.gather(answers(front, inputs), answers(second, inputs))
        for outcomes in both:
            for request, outcome in zip(inputs, outcomes, strict=True):
                assert outcome.text == expected_text(request, ANSWER)
        await wait_clear(second)
    # The second front end left; the stages it shared keep serving the first.
    outcome = await collect(front, make_request(turn("still here")))
    assert outcome.text == expected_text(turn("still here"), ANSWER)
    await wait_clear(front)


async def test_a_request_that_cannot_be_delivered_fails_at_once(front: Coordinator) -> None:
    # A param that cannot be pickled: its Submit never leaves this front end. The stream's idle
    # timeout (60 s) must not be what ends it.
    request = make_request(turn("undeliverable"), unpicklable=lambda: None)
    with pytest.raises(PipelineError, match="lost on the way to stage thinker"):
        await collect(front, request, timeout=10)
    await wait_clear(front)
    outcome = await collect(front, make_request(turn("delivered")))
    assert outcome.text == expected_text(turn("delivered"), ANSWER)


async def test_an_abort_storm_leaves_no_state_on_any_node(front: Coordinator) -> None:
    rng = random.Random(16)

    async def aborted_at_random(i: int) -> None:
        request = make_request(turn(f"storm {i}"), toy_never_stop=rng.random() < 0.5)
        stream = front.stream(request)
        chunks = rng.randrange(0, 6)
        async with asyncio.timeout(30):
            for _ in range(chunks):
                if await anext(stream, None) is None:
                    break
            await asyncio.sleep(rng.random() * 0.02)
            await asyncio.wait_for(front.abort(request.request_id), 5)
            await stream.aclose()

    for wave in range(5):  # 100 aborts, 20 streams at a time
        await asyncio.gather(*(aborted_at_random(wave * 20 + i) for i in range(20)))
    await wait_clear(front)
    stats = await front.stage_stats()  # every stage answered, on every node: all hold nothing
    assert set(stats) == {s.name for s in SHARED.stages}
    nodes = {info["node_id"] for info in (await placement(SHARED)).values()}
    assert len(nodes) == 2, nodes


async def test_a_killed_stage_actor_fails_its_requests_and_is_restarted(front: Coordinator) -> None:
    before = await placement(SHARED)
    request = make_request(turn("interrupted"), toy_never_stop=True)
    stream = front.stream(request)
    await asyncio.wait_for(anext(stream), 20)
    # The thinker dies mid-answer; the talker and decode hold the request, waiting for its tokens.
    os.kill(before["thinker"]["pid"], signal.SIGKILL)
    with pytest.raises(PipelineError, match="thinker") as failure:
        async with asyncio.timeout(20):
            async for _ in stream:
                pass
    assert "lost" in str(failure.value) or "restarted" in str(failure.value)
    async with asyncio.timeout(60):
        while not front.ready:
            await asyncio.sleep(0.05)
    after = await placement(SHARED)
    assert after["thinker"]["incarnation"] != before["thinker"]["incarnation"]
    assert {s: i["pid"] for s, i in after.items() if s != "thinker"} == {
        s: i["pid"] for s, i in before.items() if s != "thinker"
    }
    await wait_clear(front)  # the survivors let go of the request the thinker took with it
    outcome = await collect(front, make_request(turn("served again")), timeout=30)
    assert outcome.text == expected_text(turn("served again"), ANSWER)


async def test_a_node_removed_mid_answer_fails_requests_and_stages_come_back(
    cluster: Cluster, front: Coordinator
) -> None:
    where = await placement(SHARED)
    doomed = where["thinker"]["node_id"]
    request = make_request(turn("cut off"), toy_never_stop=True)
    stream = front.stream(request)
    await asyncio.wait_for(anext(stream), 20)
    node = next(n for n in cluster.worker_nodes if n.node_id == doomed)
    cluster.remove_node(node)
    with pytest.raises(PipelineError, match="lost|restarted|crashed"):
        async with asyncio.timeout(30):
            async for _ in stream:
                pass
    async with asyncio.timeout(120):
        while not front.ready:
            await asyncio.sleep(0.05)  # readiness arrives with the restarted actors' Ready
    after = await placement(SHARED)
    assert after["thinker"]["node_id"] != doomed
    assert after["thinker"]["incarnation"] != where["thinker"]["incarnation"]
    outcome = await collect(front, make_request(turn("back again")), timeout=30)
    assert outcome.text == expected_text(turn("back again"), ANSWER)
    assert sorted(outcome.finals) == ["code2wav", "decode"]
    await wait_clear(front)  # the survivors hold nothing of the request the loss failed
