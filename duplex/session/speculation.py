"""A speculative response: the answer to a turn begun at a pause, before the turn is known to have
ended, so that a patient turn detector still answers fast.

Under semantic_vad, when a pause of the user's turn is long enough for its words to be asked about
(``WORDS_AT_MS``), the session submits the request it would submit if the turn ended there (the
history and the turn's audio so far) and a :class:`Speculation` streams it into a buffer. Nothing
of it reaches the client or the history. Then either:

- the turn ends in that pause: the session commits the turn as usual and a :class:`Response` adopts
  the speculation (``chunks``): what came so far is replayed in order, the rest streams through,
  and the user hears the answer a preprocessing, prefill and first tokens sooner;
- the user goes on speaking: the session withdraws it (``ModelPipeline.withdraw``: an abort,
  acknowledged by every stage as any abort), and it leaves nothing: no event, no item, no pipeline
  state, even where its answer was all generated before the abort.

Where the pipeline recognises speech (its chunks carry ``input_transcript``), the transcript is
handed to ``on_transcript`` as soon as it comes, with the pipeline's judgement of whether those
words are finished where it makes one (``input_end_of_turn``, asked for by
``params["end_of_turn"]``): the words of the turn so far are the turn detector's text cue
(:mod:`duplex.turns.transcript_cue`, :func:`duplex.turns.end_of_turn.with_text`).

A Speculation lives from the pause that began it until it is adopted or aborted;
``duplex_speculative_responses_total`` counts each by outcome. A session's :class:`Speculator`
holds at most one at a time (and the aborts still on their way), and is closed with the session.

Where the model keeps the conversation's state (``keep_model_state``), a speculative request
continues it like any turn, so the prefill of the new turn happens in the pause: withdrawing it
puts the pipeline's state back to before the request, also where it had ended (``on_withdrawn``
tells the session's :class:`~duplex.session.model_state.KeptModelState` which request it was),
and an adopted speculation's audio is the turn's committed audio, so that the next turn continues
exactly what the model heard.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import numpy as np

from duplex import metrics
from duplex.media.video_window import TurnPictures
from duplex.session.model_pipeline import ModelPipeline
from duplex.turns.semantic_policy import WORDS_AT_MS
from duplex.turns.server_vad import TurnDetector
from pipeline.coordinator import PipelineError, PipelineOverloaded
from pipeline.proto import OmniRequest, OutputChunk

log = logging.getLogger(__name__)

_END = None

# (the pause, the words heard up to it, P(finished) from those words where the pipeline judged it)
Heard = Callable[[int, str, float | None], None]


class Speculation:
    def __init__(self, pipeline: ModelPipeline, request: OmniRequest, audio: np.ndarray, pause: int,
                 on_transcript: Heard, log_extra: dict[str, str]) -> None:
        self.request = request
        self.audio = audio  # the turn's audio so far, as the request's last message holds it
        # and the pictures of the caller's camera it holds (none without one), with when each was
        # seen: the adopted turn's item keeps them as a video
        turn = request.inputs["messages"][-1]
        self.pictures = TurnPictures(list(turn.get("images") or []), turn.get("image_times"))
        self.pause = pause  # the sample position where the pause that began it started
        self._pipeline = pipeline
        self._on_transcript = on_transcript
        self._chunks: asyncio.Queue[OutputChunk | Exception | None] = asyncio.Queue()
        self._outcome: str | None = None
        self.log = logging.LoggerAdapter(log, {**log_extra, "request_id": request.request_id})
        self._task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for chunk in self._pipeline.stream(self.request):
                transcript = chunk.data.get("input_transcript")
                if transcript is not None and self._outcome is None:
                    finished = chunk.data.get("input_end_of_turn")
                    self._on_transcript(self.pause, str(transcript),
                                        None if finished is None else float(finished))
                self._chunks.put_nowait(chunk)
        except (PipelineError, PipelineOverloaded) as err:
            # The adopting response reports it; an aborted speculation has nobody to tell.
            self._chunks.put_nowait(err)
        finally:
            self._chunks.put_nowait(_END)

    def adopt(self) -> AsyncIterator[OutputChunk]:
        """The request's chunks for the response that answers the turn: those buffered, then the
        rest as they come. Called once, instead of ``abort``."""
        self._settle("adopted")
        return self._replay()

    async def _replay(self) -> AsyncIterator[OutputChunk]:
        while (chunk := await self._chunks.get()) is not _END:
            if isinstance(chunk, Exception):
                raise chunk
            yield chunk

    async def abort(self) -> None:
        """The user went on: withdraw the request (abort it, and undo its turn in the kept state
        even where it ended) and return once every stage released it."""
        self._settle("aborted")
        await self._pipeline.withdraw(self.request.request_id)
        await asyncio.gather(self._task, return_exceptions=True)

    def _settle(self, outcome: str) -> None:
        assert self._outcome is None, f"speculation already {self._outcome}"
        self._outcome = outcome
        metrics.SPECULATIVE_RESPONSES_TOTAL.labels(outcome).inc()
        self.log.info("speculative request %s %s", self.request.request_id, outcome)


class Speculator:
    """One session's speculative answers (module doc): at most one, for the current pause."""

    def __init__(self, pipeline: ModelPipeline, on_transcript: Heard,
                 on_withdrawn: Callable[[str], None], log_extra: dict[str, str]) -> None:
        self._pipeline = pipeline
        self._on_transcript = on_transcript
        self._on_withdrawn = on_withdrawn
        self._log_extra = log_extra
        self._current: Speculation | None = None
        self._last_pause: int | None = None  # one speculation per pause, even if dropped
        self._aborts: set[asyncio.Task[None]] = set()

    def step(self, detector: TurnDetector, may_start: bool,
             request_for: Callable[[np.ndarray], OmniRequest]) -> None:
        """After each VAD window: drop the speculation when the user went on (or it may no longer
        run), begin one when a pause reaches the end-of-turn model's ask (``request_for`` builds
        the request for the turn's audio so far)."""
        pausing = detector.in_speech and detector.silence_ms > 0
        current = self._current
        if current is not None and not (may_start and pausing and detector.pause_start == current.pause):
            self._drop()
        if (self._current is None and may_start and pausing
                and detector.silence_ms >= WORDS_AT_MS and detector.pause_start != self._last_pause):
            self._last_pause = detector.pause_start
            audio = detector.turn_audio()
            self._current = Speculation(self._pipeline, request_for(audio), audio,
                                        detector.pause_start, self._on_transcript, self._log_extra)

    @property
    def active(self) -> bool:
        """Whether an answer is speculated now (the conversation's request in flight)."""
        return self._current is not None

    def take(self) -> Speculation | None:
        """The speculation for the turn that just ended in its pause (to adopt), if any."""
        current, self._current = self._current, None
        return current

    def _drop(self) -> None:
        current, self._current = self._current, None
        if current is not None:
            self._on_withdrawn(current.request.request_id)
            task = asyncio.get_running_loop().create_task(current.abort())
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

    async def close(self) -> None:
        """Abort what is speculated and return once every abort was acknowledged."""
        self._drop()
        await asyncio.gather(*self._aborts, return_exceptions=True)
