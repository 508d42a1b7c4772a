"""``mm_aggregate`` when a branch fails or is aborted, on the tiny preset served by ``start_pipeline``.

The image encoder is the real runner with a fault put in front of it (the only fake: nothing a
client sends makes the real tower raise): for requests whose id starts with ``gated-`` it waits
until the test opens the gate, then raises (``-boom``) or encodes. That holds the image branch in
flight while the fan-in already holds the other two branches' parts, so the test can fail it or
abort it there. Every time: the request ends as it should (an error naming ``image_encoder``, or
cancelled), an image request after it is answered, and every stage gets back to 0 live requests
with no shared memory held.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from harness.speech import speech
from pipeline import runner
from pipeline.coordinator import Coordinator, PipelineError
from pipeline.models.qwen3_omni.vision import ImageEncoder
from pipeline.proto import OmniRequest
from pipeline.runner import build_stage
from pipeline.scheduling.base import BatchItem, RequestError
from pipeline.stage import Stage
from tests.models.conftest import tiny_config
from tests.models.test_qwen3_omni_vision import pattern
from tests.pipeline.helpers import collect, running, wait_clear

CONFIG = tiny_config()


class Gate:
    """Holds the image encoder's batches of gated requests until ``open`` (test thread -> worker)."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()

    def run(self, original: Any, encoder: ImageEncoder, batch: list[BatchItem]) -> Any:
        gated = [i.payload.request_id for i in batch if i.payload.request_id.startswith("gated-")]
        if gated:
            self.entered.set()
            if not self.opened.wait(30):
                raise RuntimeError("the test never opened the gate")
            for rid in gated:
                if rid.endswith("-boom"):
                    raise RequestError(rid, "the vision tower failed (injected)")
        return original(encoder, batch)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    held = Gate()
    original = ImageEncoder.run
    monkeypatch.setattr(ImageEncoder, "run", lambda self, batch: held.run(original, self, batch))
    yield held
    held.opened.set()


class Served:
    """The pipeline and its stages (in this process: inproc), to read a stage whose neighbour's
    worker the gate holds (``stage_stats`` waits for every stage, the held one too)."""

    def __init__(self) -> None:
        self.stages: dict[str, Stage] = {}
        self.coordinator: Coordinator | None = None

    def live(self, name: str) -> int:
        return self.stages[name]._stats(None).live_requests


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[Served]:
    out = Served()

    def build(*args: Any) -> Stage:
        stage = build_stage(*args)
        out.stages[stage.name] = stage
        return stage

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "build_stage", build)
        async with running(CONFIG, "inproc") as started:
            out.coordinator = started
            yield out


@pytest.fixture
def coordinator(served: Served) -> Coordinator:
    assert served.coordinator is not None
    return served.coordinator


def image_turn(rid: str) -> OmniRequest:
    return OmniRequest(rid, {"messages": [{
        "role": "user", "audio": speech("look at this"), "sample_rate": 16000, "images": [pattern(64, 96)],
    }]})


async def fan_in_holds(served: Served, count: int) -> None:
    """Poll (with a deadline) until the fan-in holds parts of ``count`` requests."""
    async with asyncio.timeout(30):
        while served.live("mm_aggregate") != count:
            await asyncio.sleep(0.01)


async def held_in_the_fan_in(served: Served, gate: Gate) -> None:
    """The fan-in holds the request's preprocessing and audio parts; its image is in the tower."""
    assert await asyncio.to_thread(gate.entered.wait, 30)
    await fan_in_holds(served, 1)


async def test_a_failing_branch_fails_the_request_naming_it(
    served: Served, coordinator: Coordinator, gate: Gate
) -> None:
    failing = asyncio.create_task(collect(coordinator, image_turn("gated-1-boom"), timeout=60))
    await held_in_the_fan_in(served, gate)
    gate.opened.set()
    with pytest.raises(PipelineError, match="vision tower failed") as failure:
        await failing
    assert failure.value.stage == "image_encoder"
    await wait_clear(coordinator)
    beside = await collect(coordinator, image_turn("plain-1"), timeout=60)
    assert {"decode", "code2wav"} <= set(beside.finals)
    await wait_clear(coordinator)


async def test_a_branch_aborted_mid_flight_leaves_nothing(
    served: Served, coordinator: Coordinator, gate: Gate
) -> None:
    request = image_turn("gated-2")
    stream = asyncio.create_task(collect(coordinator, request, timeout=60))
    await held_in_the_fan_in(served, gate)
    abort = asyncio.create_task(coordinator.abort(request.request_id))
    # The aborted fan-in lets go at once, while the tower's batch still runs; once the gate opens,
    # the image encoder drops that batch's output for a request it no longer has.
    await fan_in_holds(served, 0)
    gate.opened.set()
    await asyncio.wait_for(abort, 30)
    outcome = await stream
    assert "code2wav" not in outcome.finals
    await wait_clear(coordinator)
    beside = await collect(coordinator, image_turn("plain-2"), timeout=60)
    assert {"decode", "code2wav"} <= set(beside.finals)
    await wait_clear(coordinator)
