"""Fair admission (``pipeline/admission.py``): one owner's flood of requests is refused beyond its
share and never takes the last slots from another owner's ordinary turn; requests without an
owner keep the plain ``max_in_flight`` bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import replace

import pytest

from pipeline import admission
from pipeline.coordinator import PipelineOverloaded
from pipeline.proto import OutputChunk
from tests.pipeline.helpers import (
    collect,
    expected_text,
    make_request,
    running,
    toy_config,
    turn,
    wait_clear,
)

TOY = toy_config(max_in_flight=8, owner_share=2)
ANSWER = int(TOY.stage("thinker").options["answer_tokens"])


@pytest.mark.parametrize(("in_flight", "owner", "admitted"), [
    ([None] * 7, None, True),
    ([None] * 8, None, False),
    (["a"] * 5, "a", True),            # beyond its share while more than `share` slots are free
    (["a"] * 6, "a", False),           # ... but not into the last `share` slots
    (["a"] * 6 + ["b"], "b", True),    # an owner below its share takes them
    (["a"] * 6 + ["b"], "c", True),
    (["a"] * 6 + ["b", "c"], "d", False),  # max_in_flight still bounds everyone
    ([None] * 6, "a", True),
])
def test_the_rule(in_flight: list[str | None], owner: str | None, admitted: bool) -> None:
    if admitted:
        admission.check(TOY, in_flight, owner)
    else:
        with pytest.raises(PipelineOverloaded):
            admission.check(TOY, in_flight, owner)


def test_the_default_share_is_a_quarter() -> None:
    assert admission.owner_share(toy_config(max_in_flight=16)) == 4
    assert admission.owner_share(toy_config(max_in_flight=2)) == 1


async def test_a_flood_fails_its_owner_and_not_another_owners_turn() -> None:
    async with running(TOY, "inproc") as toy:
        flood: list[AsyncGenerator[OutputChunk, None]] = []
        with pytest.raises(PipelineOverloaded, match="'flood' holds 6"):
            for i in range(TOY.max_in_flight):
                request = make_request(turn(f"flood {i}"), toy_never_stop=True)
                stream = toy.stream(replace(request, owner="flood"))
                await asyncio.wait_for(anext(stream), 10)  # admitted, and answering
                flood.append(stream)
        assert len(flood) == TOY.max_in_flight - admission.owner_share(TOY)
        inputs = turn("my turn")
        outcome = await collect(toy, replace(make_request(inputs), owner="caller"))
        assert outcome.text == expected_text(inputs, ANSWER)
        for stream in flood:
            await stream.aclose()
        await wait_clear(toy)
