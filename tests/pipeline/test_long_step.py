"""A step that computes for longer than ``hang_timeout_s`` (a big prefill on a slow machine) is
not a hang: the stage answers the coordinator's sign-of-life question while its worker uses CPU
time, so the request completes and nothing is restarted. (A worker blocked for good is still
found: ``test_hung_stage.py``.)"""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.scheduling.ar import ARScheduler
from pipeline.scheduling.base import StepResult
from tests.pipeline.helpers import collect, expected_text, make_request, running, toy_config, turn

HANG_TIMEOUT_S = 1.0
TOY = toy_config(hang_timeout_s=HANG_TIMEOUT_S)
ANSWER = int(TOY.stage("thinker").options["answer_tokens"])


async def test_a_step_longer_than_the_hang_timeout_that_computes_is_not_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    step = ARScheduler.step
    first = threading.Event()

    def one_long_step(self: ARScheduler) -> list[StepResult]:
        if not first.is_set():
            first.set()
            end = time.perf_counter() + 3 * HANG_TIMEOUT_S
            while time.perf_counter() < end:  # computes all along, as a long forward pass does
                pass
        return step(self)

    monkeypatch.setattr(ARScheduler, "step", one_long_step)
    async with running(TOY, "inproc") as toy:
        inputs = turn("a long prefill")
        outcome = await collect(toy, make_request(inputs), timeout=30)
        assert first.is_set()
        assert outcome.text == expected_text(inputs, ANSWER)
        assert toy.failure is None and toy.ready
