"""A send that cannot be queued fails its request only, and leaves nothing behind: no request
state in any stage (``pipeline_stage_live_requests`` back at 0), no pipeline slot, no shared-memory
segment; the next request is answered.

Two real causes: a full /dev/shm (a 1 MiB tmpfs mounted on /dev/shm in a private mount namespace:
``tests/pipeline/full_shm.py``), and a ZMQ queue at its high-water mark (the receiving stage
process is stopped with SIGSTOP and its socket filled until a send would block; or, for a stage's
own output, a downstream endpoint that never reads).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from pipeline.coordinator import PipelineError
from pipeline.models import StageContext
from pipeline.models.toy import make_talker
from pipeline.proto import COORDINATOR, AbortAck, Failed, Ready, StatsRequest, StreamChunk
from pipeline.scheduling import build_scheduler
from pipeline.stage import Stage
from pipeline.transport.base import SendError
from pipeline.transport.zmq_ipc import ZmqEndpoint
from tests.pipeline.helpers import (
    REPO,
    audio_turn,
    collect,
    expected_text,
    make_request,
    own_segments,
    running,
    toy_config,
    turn,
    wait_clear,
)
from tests.pipeline.test_stage import PEERS, TALKER, Harness, token

TOY = toy_config()
ANSWER = int(TOY.stage("thinker").options["answer_tokens"])
FLOOD_LIMIT = 1_000_000  # messages; a socket that never fills fails the test instead of looping


def fill_until_full(endpoint: ZmqEndpoint, target: str) -> int:
    """Send small messages to ``target`` until one would block; how many were queued."""
    for sent in range(FLOOD_LIMIT):
        try:
            endpoint.send(target, StatsRequest(0))
        except SendError:
            return sent
    raise AssertionError(f"{target}'s queue never filled")


def live_gauges(stages: list[str]) -> dict[str, float | None]:
    return {
        s: REGISTRY.get_sample_value("pipeline_stage_live_requests", {"stage": s}) for s in stages
    }


def test_a_full_dev_shm_fails_the_request_and_leaves_nothing() -> None:
    mount = "mount --make-rprivate / && mount -t tmpfs -o size=1m tmpfs /dev/shm"
    run = f"{mount} && exec {sys.executable} -m tests.pipeline.full_shm"
    result = subprocess.run(
        ["unshare", "--mount", "--", "bash", "-c", run],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]


async def test_a_stage_at_its_high_water_mark_fails_the_request_and_leaves_nothing() -> None:
    async with running(TOY, "process") as coordinator:
        entry = coordinator.stage_pids[TOY.entry]
        os.kill(entry, signal.SIGSTOP)
        try:
            queued = fill_until_full(coordinator._endpoint, TOY.entry)
            request = make_request(audio_turn(64000))  # its audio rides a shm segment
            with pytest.raises(PipelineError, match="could not send the request.*queue is full"):
                await collect(coordinator, request, timeout=10)
            assert coordinator.requests_in_flight == 0
            assert own_segments(list(coordinator.stage_pids.values())) == []
        finally:
            os.kill(entry, signal.SIGCONT)
        assert queued > 0
        await wait_clear(coordinator)
        names = [s.name for s in TOY.stages]
        assert live_gauges(names) == {s: 0.0 for s in names}
        answer = make_request(turn("and now"))
        assert (await collect(coordinator, answer)).text == expected_text(answer.inputs, ANSWER)
        await wait_clear(coordinator)


async def test_an_output_a_stage_cannot_send_fails_its_request_and_releases_it(
    directory: Path, tmp_path: Path
) -> None:
    """The talker's downstream (code2wav) is gone: once the queue to it is full, the talker's next
    frame for a request cannot be sent; the talker fails that request, releases it (its ack says
    when) and gives back the segment it lifted the frame into."""
    endpoints = {n: ZmqEndpoint(n, directory, shm_threshold=0) for n in (TALKER.name, *PEERS)}
    endpoints["code2wav"].close()
    endpoints["code2wav"] = ZmqEndpoint("code2wav", tmp_path, shm_threshold=0)  # elsewhere
    talker = build_scheduler(TALKER, make_talker(StageContext(TALKER, {})))
    h = Harness(endpoints, Stage(TALKER, talker, endpoints[TALKER.name]))
    try:
        await h.expect(COORDINATOR, Ready)
        assert fill_until_full(endpoints[TALKER.name], "code2wav") > 0
        h.send("thinker", StreamChunk(token("req-a", 5), "thinker", 0))
        failed = await h.expect(COORDINATOR, Failed, "req-a")
        assert failed.source == TALKER.name and "could not send its output" in failed.error
        await h.expect(COORDINATOR, AbortAck, "req-a")  # the scheduler let go of it
        stats = await h.stats()
        assert (stats.live_requests, stats.queue_depth, stats.shm_bytes) == (0, 0, 0)
        assert h.received("code2wav", "req-a") == []
    finally:
        await h.close()
