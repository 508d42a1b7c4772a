"""A full /dev/shm, for real: run as ``python -m tests.pipeline.full_shm`` in a private mount
namespace whose /dev/shm is a 1 MiB tmpfs (``test_send_failures`` does so with ``unshare --mount``).

A stage-process pipeline serves while /dev/shm is filled up: a request whose audio must be lifted
into shared memory fails at the coordinator's send, and one whose outputs must be lifted fails at
a stage's send; each fails its response with a clear error and leaves no request state, no slot
and no segment. Once space is free again, the next request is answered. Exits non-zero (an
AssertionError) on any difference; prints ``ok`` at the end.
"""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

from prometheus_client import REGISTRY

from pipeline.coordinator import Coordinator, PipelineError
from pipeline.transport.shm import SHM_DIR, leftover_segments
from tests.pipeline.helpers import (
    audio_turn,
    collect,
    expected_text,
    make_request,
    running,
    toy_config,
    turn,
    wait_clear,
)

# Every tensor of 1 KiB or more rides shared memory: the thinker's hidden states to the talker,
# code2wav's audio to the coordinator, a request's audio to the thinker.
CONFIG = toy_config(shm_threshold_bytes=1024)
ANSWER = int(CONFIG.stage("thinker").options["answer_tokens"])
AUDIO_SAMPLES = 64000  # 250 KiB of float32


def fill(path: Path) -> None:
    """Write ``path`` until the file system is full."""
    block = b"\0" * 65536
    with path.open("wb", buffering=0) as file:
        try:
            while True:
                file.write(block)
        except OSError as err:
            assert err.errno == errno.ENOSPC, err


async def assert_nothing_left(coordinator: Coordinator) -> None:
    await wait_clear(coordinator)
    assert leftover_segments() == []
    for stage in CONFIG.stages:
        # None (a gauge never reported) fails as surely as a count above zero.
        live = REGISTRY.get_sample_value("pipeline_stage_live_requests", {"stage": stage.name})
        assert live == 0.0, (stage.name, live)


async def main() -> None:
    assert SHM_DIR.stat().st_dev != Path("/").stat().st_dev, "run me with /dev/shm on a tmpfs"
    async with running(CONFIG, "process") as coordinator:
        filler = SHM_DIR / "filler"
        fill(filler)

        lifted_at_entry = make_request(audio_turn(AUDIO_SAMPLES))
        try:
            await collect(coordinator, lifted_at_entry)
            raise AssertionError("a request whose audio finds no shared memory was answered")
        except PipelineError as err:
            assert "could not send the request" in str(err), err
            assert "No space left on device" in str(err), err
        assert coordinator.requests_in_flight == 0  # the slot is free at once
        assert leftover_segments() == []  # and no half-written segment is left
        await assert_nothing_left(coordinator)

        lifted_in_a_stage = make_request(turn("what is in shared memory"))
        try:
            await collect(coordinator, lifted_in_a_stage)
            raise AssertionError("a request whose outputs find no shared memory was answered")
        except PipelineError as err:
            assert "could not send its output" in str(err), err
            assert "No space left on device" in str(err), err
        await assert_nothing_left(coordinator)

        filler.unlink()
        again = make_request(audio_turn(AUDIO_SAMPLES))
        outcome = await collect(coordinator, again)
        assert outcome.text == expected_text(again.inputs, ANSWER)
        assert len(outcome.audio) > 0
        await assert_nothing_left(coordinator)
    print("ok")


if __name__ == "__main__":
    asyncio.run(main())
