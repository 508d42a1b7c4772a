"""Prefill the user's turn while they speak, so that its end leaves only the last piece to do.

Where the model keeps the conversation's state (``keep_model_state``) and ``prefill_piece_s`` is
set, each time the user's turn has grown by another ``prefill_piece_s`` seconds of audio (plus the
little the model reads past a piece: ``PARTIAL_MARGIN_MS``), the session submits a partial request:
the history and the turn so far, of which the model encodes and prefills the next piece into the
conversation's kept state, answering nothing (``RequestBuilder.partial``). When the turn ends, the
answer's request continues that state: only the audio after the last piece is left to encode and
prefill, however long the user spoke. (The first pieces of a turn also continue the state the
previous answer left, so the history is never prefilled again either.)

Pieces go only while nothing else of the conversation runs (no response, no barge-in, no
speculative answer), one at a time: a request that comes while a piece is in flight waits in the
pipeline for it (``ConversationKeeping.prepare``). A turn that is dropped (a false interruption, a
cleared buffer) needs nothing here: the next request does not continue its open turn, and the
pipeline undoes it first. A piece that fails leaves the pipeline nothing it would continue, so the
next turn is a full prefill: slower, never wrong. ``duplex_prefill_pieces_total`` counts pieces
by outcome.

A session's TurnPrefill lives as long as the session and holds at most one piece in flight (its
task); ``close`` aborts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np

from duplex import metrics
from duplex.session.model_pipeline import ModelPipeline
from duplex.turns.server_vad import TurnDetector
from duplex.turns.vad import SAMPLE_RATE
from pipeline.coordinator import PipelineError, PipelineOverloaded
from pipeline.proto import OmniRequest
from pipeline.scheduling.conversation_book import PARTIAL_MARGIN_MS, PARTIAL_PARAM

log = logging.getLogger(__name__)

MARGIN = PARTIAL_MARGIN_MS * SAMPLE_RATE // 1000


class TurnPrefill:
    def __init__(self, pipeline: ModelPipeline, piece_s: int, log_extra: dict[str, str]) -> None:
        self._pipeline = pipeline
        self._piece_s = piece_s
        self.log = logging.LoggerAdapter(log, log_extra)
        self._turn: int | None = None  # the turn pieces were sent for (its start), and how far
        self._held = 0
        self._task: asyncio.Task[None] | None = None
        self._request: str | None = None  # the piece in flight

    def step(self, detector: TurnDetector, may_start: bool,
             request_for: Callable[[np.ndarray, int], OmniRequest]) -> None:
        """After each VAD window: send the turn's next piece once its audio is there, where no
        piece is in flight and a piece may go (``request_for`` builds it from the turn's audio so
        far and the seconds to prefill)."""
        if self._piece_s <= 0 or not detector.in_speech:
            return
        if detector.turn_start != self._turn:
            self._turn, self._held = detector.turn_start, 0
        until = self._held + self._piece_s
        if (not may_start or (self._task is not None and not self._task.done())
                or detector.turn_samples < until * SAMPLE_RATE + MARGIN):
            return
        self._held = until
        request = request_for(detector.turn_audio(), until)
        self._request = request.request_id
        self._task = asyncio.get_running_loop().create_task(self._run(request))

    async def _run(self, request: OmniRequest) -> None:
        rid = request.request_id
        try:
            async for _ in self._pipeline.stream(request):
                pass
        except (PipelineError, PipelineOverloaded) as err:
            metrics.PREFILL_PIECES_TOTAL.labels("failed").inc()
            self.log.warning("request %s: piece of the turn not prefilled: %s", rid, err)
            return
        metrics.PREFILL_PIECES_TOTAL.labels("done").inc()
        self.log.debug("request %s: turn prefilled to %d s", rid, request.params[PARTIAL_PARAM])

    async def close(self) -> None:
        """Abort the piece in flight (the session ended) and return once every stage released it."""
        task, self._task = self._task, None
        if task is not None and not task.done() and self._request is not None:
            await self._pipeline.abort(self._request)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
