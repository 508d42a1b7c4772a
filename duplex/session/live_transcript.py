"""Transcribe the user's turn while they speak, and tell the words as they firm up.

Where the client asked for transcription (``audio.input.transcription``), each time the turn in
progress has grown by another ``INTERVAL_S`` of audio and no hypothesis of this session is in
flight, the session sends a recognition request of the turn so far (``RequestBuilder.recognition``:
the audio alone, out of the conversation, one output token, the session's own in the pipeline's
fair share); its first ``input_transcript`` is the turn's next hypothesis and the request is left,
which aborts it. A word is final once two consecutive hypotheses agree on it
(:class:`LocalAgreement`, LocalAgreement-2): only the newly firmed words go to the client, as
``conversation.item.input_audio_transcription.delta`` of the item the turn will become (its id is
the one ``speech_started`` named). When the turn ends the hypothesis in flight is dropped; the
turn's final transcript, from the request that answers it, sends the rest
(:meth:`~duplex.session.conversation.Conversation.transcribed`).

A pipeline whose answer to a recognition request carries no ``input_transcript`` does not
transcribe (the toy preset): the session asks no more. A hypothesis that fails (overload, a
stage's error) is skipped; the next one comes after the next ``INTERVAL_S``.

A session's :class:`LiveTranscript` lives as long as the session; it holds the current turn's
agreement and at most one request in flight (its task), which ``end_turn`` drops and ``close``
drops and waits for (its abort acknowledged by every stage).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import string
from collections.abc import Callable

import numpy as np

from duplex.session.model_pipeline import ModelPipeline
from duplex.turns.server_vad import TurnDetector
from duplex.turns.vad import SAMPLE_RATE
from pipeline.coordinator import PipelineError, PipelineOverloaded
from pipeline.proto import OmniRequest

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
"""New turn audio between two hypotheses: a word firms up about two of these after it is said,
and the recogniser (Whisper on the turn so far) keeps up on two CPU cores."""

# (the item id of the turn, the words newly firmed, in order)
Firmed = Callable[[str, list[str]], None]


class LocalAgreement:
    """LocalAgreement-2 over one turn's hypotheses: a word is final once two consecutive
    hypotheses agree on it, i.e. the longest common prefix (by words) of the last two."""

    def __init__(self) -> None:
        self._previous: list[str] = []
        self._firm: list[str] = []  # the words firmed so far, as first written

    def hear(self, hypothesis: str) -> list[str]:
        """The words ``hypothesis`` firms up after those firm already (none, often)."""
        words = hypothesis.split()
        agreed = 0
        while agreed < min(len(words), len(self._previous)) and words[agreed] == self._previous[agreed]:
            agreed += 1
        self._previous = words
        held = len(self._firm)
        # A later hypothesis may punctuate a firm word anew ("there" then "there,"): it still agrees
        # with what was told. One that reads other words there cannot extend what was told.
        if agreed <= held or [_bare(w) for w in words[:held]] != [_bare(w) for w in self._firm]:
            return []
        new = words[held:agreed]
        self._firm += new
        return new


def _bare(word: str) -> str:
    """A word as a firm word is compared with a later hypothesis: without punctuation or case."""
    return word.strip(string.punctuation).lower()


class LiveTranscript:
    """One session's recognition of the turn in progress (module doc); ``on_firmed`` tells the
    client the words that firmed up."""

    def __init__(self, pipeline: ModelPipeline, on_firmed: Firmed, log_extra: dict[str, str]) -> None:
        self._pipeline = pipeline
        self._on_firmed = on_firmed
        self.log = logging.LoggerAdapter(log, log_extra)
        self._transcribes = True  # until the pipeline answers a recognition without a transcript
        self._item_id: str | None = None  # the turn heard (the item it becomes), and how far
        self._asked = 0
        self._agreement = LocalAgreement()
        self._task: asyncio.Task[None] | None = None

    def step(self, detector: TurnDetector, item_id: str | None,
             request_for: Callable[[np.ndarray], OmniRequest]) -> None:
        """After each VAD window: ``item_id`` names the user's turn in progress where it is to be
        transcribed live (None: not now). Asks for the next hypothesis when the turn has grown by
        ``INTERVAL_S`` and none is in flight (``request_for`` builds the request for its audio)."""
        if item_id is None or not detector.in_speech or not self._transcribes:
            self.end_turn()
            return
        if item_id != self._item_id:
            self.end_turn()
            self._item_id, self._asked, self._agreement = item_id, 0, LocalAgreement()
        if (self._task is not None and not self._task.done()) \
                or detector.turn_samples < self._asked + INTERVAL_S * SAMPLE_RATE:
            return
        self._asked = detector.turn_samples
        request = request_for(detector.turn_audio())
        self._task = asyncio.get_running_loop().create_task(self._hypothesis(item_id, request))

    def end_turn(self) -> None:
        """The turn ended (or is no longer transcribed): the hypothesis in flight is dropped, its
        request aborted as its task unwinds."""
        if self._task is not None:
            self._task.cancel()

    async def close(self) -> None:
        """The session closed: drop the hypothesis in flight and wait until its abort is done."""
        self._transcribes = False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _hypothesis(self, item_id: str, request: OmniRequest) -> None:
        rid = request.request_id
        # aclosing: leaving at the transcript (or cancelled) aborts the request's other stages now.
        chunks = self._pipeline.stream(request)
        try:
            async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                async for chunk in chunks:
                    transcript = chunk.data.get("input_transcript")
                    if transcript is not None:
                        self._hear(item_id, str(transcript))
                        return
        except (PipelineError, PipelineOverloaded) as err:
            self.log.warning("request %s: the turn so far not transcribed: %s", rid, err)
            return
        self._transcribes = False
        self.log.info("request %s brought back no transcript: the pipeline does not transcribe, "
                      "so the user's turns are not transcribed live in this session", rid)

    def _hear(self, item_id: str, hypothesis: str) -> None:
        if item_id != self._item_id:
            return  # a hypothesis of a turn that ended meanwhile
        firmed = self._agreement.hear(hypothesis)
        self.log.debug("turn %s heard as %r; firmed %r", item_id, hypothesis, firmed)
        if firmed:
            self._on_firmed(item_id, firmed)
