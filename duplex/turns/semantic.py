"""semantic_vad for one session: at each pause of a turn, ask the end-of-turn model (off the event
loop) whether the user has finished, and decide window by window whether to end the turn.

A :class:`SemanticTurnJudge` belongs to one session and holds one pause at a time: where it began,
the model's answer (None until it is back), the task computing it, and what the words of the
turn so far say, once a recogniser has heard them (:meth:`hear`): how they read, and the
pipeline's probability that they are finished, which joins the model's
(``probability_with_words``). Speech that resumes ends the pause: its answers, if still on their
way, are dropped. The model runs on a thread pool shared by
every session of the process (``JUDGE_THREADS``); each call is one thread of onnxruntime and numpy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools

import numpy as np

from duplex.turns.end_of_turn import shared_model
from duplex.turns.semantic_policy import MIN_SILENCE_MS, Decision, decide, probability_with_words
from duplex.turns.server_vad import TurnDetector
from duplex.turns.transcript_cue import Words, read_transcript

JUDGE_THREADS = 2


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(JUDGE_THREADS, thread_name_prefix="end-of-turn")


def _probability(audio: np.ndarray) -> float:
    """The model's answer, on a thread of the pool: the model too loads there, on first use,
    never on the event loop."""
    return shared_model().probability(audio)


class SemanticTurnJudge:
    """See module doc. ``should_end`` is called after every VAD window of the session's turn."""

    def __init__(self) -> None:
        self._pause: int | None = None  # sample position where the current pause began
        self._probability: float | None = None
        self._task: asyncio.Future[float] | None = None
        self._words: Words | None = None
        self._finished_text: float | None = None

    def should_end(self, detector: TurnDetector, eagerness: str) -> bool:
        """Whether to end the detector's turn now (asks the model once the pause is long enough)."""
        if not detector.in_speech or detector.silence_ms == 0:
            self.forget()
            return False
        if detector.pause_start != self._pause:
            self.forget()
            self._pause = detector.pause_start
        if self._task is None and detector.silence_ms >= MIN_SILENCE_MS:
            audio = detector.turn_audio()
            loop = asyncio.get_running_loop()
            self._task = loop.run_in_executor(_pool(), _probability, audio)
            self._task.add_done_callback(functools.partial(self._answered, self._pause))
        p = probability_with_words(self._probability, self._words, self._finished_text)
        decision = decide(p, detector.silence_ms, eagerness, words=self._words)
        return decision is Decision.END

    @property
    def pause(self) -> int | None:
        """Where the pause being judged began (a sample position), None between pauses."""
        return self._pause

    def hear(self, pause: int, transcript: str, finished: float | None = None) -> None:
        """The words of the turn up to the pause that began at ``pause``, as recognised, and the
        pipeline's P(finished) for them, where it judges words."""
        if pause == self._pause:
            self._words, self._finished_text = read_transcript(transcript), finished

    def _answered(self, pause: int | None, task: asyncio.Future[float]) -> None:
        if pause == self._pause and not task.cancelled() and task.exception() is None:
            self._probability = task.result()

    async def settled(self) -> None:
        """Until the model's answer for the current pause is in (tests step audio time by it)."""
        if self._task is not None:
            await asyncio.wait({self._task})

    def forget(self) -> None:
        """The pause is over (speech resumed, the turn ended or was dropped)."""
        if self._task is not None:
            self._task.cancel()
        self._pause, self._probability, self._task = None, None, None
        self._words, self._finished_text = None, None
