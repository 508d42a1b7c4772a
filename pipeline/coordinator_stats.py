"""The coordinator's stats questions to stages, and the latest StageStats of each stage.

Owned by the coordinator, on its event loop, from its start until it closes. A question lives from
``ask`` until every stage asked answered, crashed (``forget``) or the timeout; each answer (asked
or periodic) updates the stage gauges of ``pipeline.metrics``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from pipeline import metrics
from pipeline.proto import ControlMessage, StageStats, StatsRequest


class StatsQuestions:
    """``send(stage, message)`` queues a question (False: it could not be); ``own_shm()`` is the
    shared memory the coordinator's endpoint holds, for the ``pipeline_shm_bytes`` gauge."""

    def __init__(
        self, send: Callable[[str, ControlMessage], bool], own_shm: Callable[[], int]
    ) -> None:
        self._send = send
        self._own_shm = own_shm
        self.latest: dict[str, StageStats] = {}
        self._waiters: dict[int, tuple[set[str], asyncio.Future[None]]] = {}
        self._tokens = itertools.count(1)
        self._shm_by_stage: dict[str, int] = {}

    async def ask(
        self, stages: set[str], timeout: float, fresh: bool = True
    ) -> tuple[set[str], set[str]]:
        """Ask ``stages`` for a StageStats (``StatsRequest.fresh``) and wait up to ``timeout`` for
        the answers; returns (the stages asked, those of them that did not answer). A stage the
        question could not be sent to is not waited for, nor one that crashes meanwhile."""
        token = next(self._tokens)
        asked = {s for s in stages if self._send(s, StatsRequest(token, fresh))}
        waiting = set(asked)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[token] = (waiting, done)
        if not waiting:
            done.set_result(None)
        try:
            await asyncio.wait_for(done, timeout)
        except TimeoutError:
            pass
        finally:
            self._waiters.pop(token, None)
        return asked, waiting

    def forget(self, stage: str) -> None:
        """``stage`` crashed: no question waits for it any more."""
        for token in list(self._waiters):
            self._answered(token, stage)

    def on_stats(self, stats: StageStats) -> None:
        self.latest[stats.source] = stats
        metrics.PIPELINE_STAGE_LIVE_REQUESTS.labels(stats.source).set(stats.live_requests)
        metrics.PIPELINE_STAGE_QUEUE_DEPTH.labels(stats.source).set(stats.queue_depth)
        for seconds in stats.step_seconds:
            metrics.PIPELINE_STAGE_SECONDS.labels(stats.source).observe(seconds)
        metrics.PIPELINE_CONVERSATION_STATE_BYTES.labels(stats.source).set(
            sum(stats.conversations.values())
        )
        metrics.PIPELINE_CONVERSATIONS_KEPT.labels(stats.source).set(len(stats.conversations))
        self._shm_by_stage[stats.source] = stats.shm_bytes
        metrics.PIPELINE_SHM_BYTES.set(sum(self._shm_by_stage.values()) + self._own_shm())
        if stats.token is not None:
            self._answered(stats.token, stats.source)

    def _answered(self, token: int, stage: str) -> None:
        if token not in self._waiters:
            return  # asked by nobody here, or answered too late
        waiting, done = self._waiters[token]
        waiting.discard(stage)
        if not waiting and not done.done():
            done.set_result(None)
