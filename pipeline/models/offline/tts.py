"""The ``tts`` stage: speech synthesis with piper, clause by clause, as the answer streams in.

It is the audio terminal. Each output chunk is ``{"audio": float32 mono, "sample_rate",
"spoken_text"}``, where ``spoken_text`` is exactly the text that chunk's audio voices (whitespace
included), so the session can truncate the answer to what the user heard; the chunks' texts
concatenate to the answer text. Synthesis starts on the first clause (``clauses.ClauseSplitter``),
so first audio waits for one clause, never for the whole answer. A request whose ``modalities``
lack "audio" ends with no synthesis at all.

Runs under the ``ar`` scheduler: one step voices one clause per request; the step cap
(``max_new_tokens``) bounds the clauses of an answer and ``max_clause_chars`` each clause, which
also bounds how long an abort waits for the synthesis in progress. Per-request state: one
``SpeechState`` (the splitter's pending text and the clauses not yet voiced) in the scheduler's
ARSlot, from the first text delta until ``release`` (end, failure or abort).

Several answers at once: only one slot is runnable at a time, the one whose listener runs out of
audio first (earliest deadline first, ``Speaker.runnable``), and the preset's ``max_batch: 1`` sends
each clause the moment it is voiced. A new answer's first clause is due the moment it is ready, so
it goes ahead of the tails of answers already playing, whose listeners still have audio queued.

piper-tts is GPL-3.0 and an optional extra: without it, building this stage fails with an error
that names the extra to install.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.models import StageContext
from pipeline.models.offline.clauses import ClauseSplitter
from pipeline.models.offline.sources import OFFLINE_EXTRA, MissingModelPackage, voice_model
from pipeline.proto import StagePayload
from pipeline.scheduling.base import ARSlot, ARStepResult

log = logging.getLogger(__name__)


@dataclass
class SpeechState:
    """One answer's synthesis: its pending text and clauses, and when its listener needs the next
    clause (``due``, monotonic seconds: when its first clause was ready, then when the audio
    voiced so far, played from its first clause on, runs out; None before the first clause)."""

    speak: bool
    splitter: ClauseSplitter
    clauses: deque[str] = field(default_factory=deque)
    voiced: int = 0
    due: float | None = None


def load_voice(model: Any, threads: int) -> Any:
    """A PiperVoice whose ONNX session uses ``threads`` threads (piper's loader takes them all)."""
    try:
        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig
    except ImportError as err:
        raise MissingModelPackage(
            f"speech synthesis needs piper-tts (GPL-3.0, an optional extra): {OFFLINE_EXTRA}"
        ) from err
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    config = json.loads(model.with_name(model.name + ".json").read_text())
    session = onnxruntime.InferenceSession(
        str(model), sess_options=options, providers=["CPUExecutionProvider"]
    )
    return PiperVoice(config=PiperConfig.from_dict(config), session=session)


class Speaker:
    """The ``tts`` stage's ARRunner. Holds the voice only; per-request state is in the slots.

    The packaged voice has one speaker, so the request's ``voice`` param changes nothing here (the
    preset lists the names a client may ask for).
    """

    def __init__(self, ctx: StageContext) -> None:
        options = ctx.stage.options
        # The slots this runner has seen and not yet released, to choose the most urgent.
        self._slots: dict[str, ARSlot] = {}
        self._voice = load_voice(
            voice_model(str(ctx.model_args.get("voice", "packaged"))), ctx.stage.threads
        )
        from piper.config import SynthesisConfig

        # No per-clause normalisation: it would make every clause equally loud, however short.
        self._synthesis = SynthesisConfig(
            normalize_audio=False, length_scale=options.get("length_scale")
        )
        self.sample_rate = int(self._voice.config.sample_rate)
        self._min_chars = int(options.get("min_clause_chars", 10))
        self._max_chars = int(options.get("max_clause_chars", 160))
        self._first_words = int(options.get("first_clause_words", 0))

    def new_state(self, payload: StagePayload) -> SpeechState:
        modalities = payload.params.get("modalities") or ["text", "audio"]
        return SpeechState("audio" in modalities, ClauseSplitter(self._min_chars, self._max_chars,
                                                                    self._first_words))

    def feed(self, slot: ARSlot, payload: StagePayload) -> None:
        state: SpeechState = slot.state
        text = payload.data.get("text")
        if state.speak and text:
            self._queue(slot, state.splitter.push(text))

    def close_input(self, slot: ARSlot, payload: StagePayload) -> None:
        state: SpeechState = slot.state
        if state.speak:
            self._queue(slot, state.splitter.flush())

    def _queue(self, slot: ARSlot, clauses: list[str]) -> None:
        state: SpeechState = slot.state
        self._slots[slot.request_id] = slot
        state.clauses.extend(clauses)
        if state.due is None and state.clauses:
            state.due = time.monotonic()  # the first clause: the listener is waiting already

    def runnable(self, slot: ARSlot) -> bool:
        """Whether the slot is the one to step next: of the slots with something to do, the one
        due first (a slot that only has to finish goes first: it costs nothing)."""
        self._slots[slot.request_id] = slot
        if not _has_work(slot):
            return False
        return min((s for s in self._slots.values() if _has_work(s)), key=_due) is slot

    def output_cap(self, slot: ARSlot) -> int | None:
        return None

    def step(self, slots: list[ARSlot]) -> list[ARStepResult]:
        return [self._step_one(slot) for slot in slots]

    def _step_one(self, slot: ARSlot) -> ARStepResult:
        state: SpeechState = slot.state
        if not state.clauses:
            return ARStepResult(None, finished=True)  # input closed, everything voiced
        clause = state.clauses.popleft()
        audio = self._synthesize(clause)
        state.voiced += 1
        # Playback of this clause starts when it is voiced, or when the audio before it ends.
        state.due = max(state.due or 0.0, time.monotonic()) + audio.size / self.sample_rate
        log.debug(
            "request %s: clause %d voiced (%.2f s): %r",
            slot.request_id,
            state.voiced,
            audio.size / self.sample_rate,
            clause,
        )
        done = slot.input_closed and not state.clauses
        return ARStepResult(
            {"audio": audio, "sample_rate": self.sample_rate, "spoken_text": clause}, finished=done
        )

    def _synthesize(self, clause: str) -> np.ndarray:
        pieces = [
            c.audio_float_array for c in self._voice.synthesize(clause.strip(), self._synthesis)
        ]
        return np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)

    def finish(self, slot: ARSlot, capped: bool) -> dict[str, Any] | None:
        if capped:
            log.info("request %s: synthesis stopped at its clause cap", slot.request_id)
        return None

    def release(self, slot: ARSlot) -> None:
        self._slots.pop(slot.request_id, None)
        slot.state = None


def _has_work(slot: ARSlot) -> bool:
    """A clause to voice, or the input closed (the step that ends the request)."""
    return bool(slot.state.clauses) or slot.input_closed


def _due(slot: ARSlot) -> float:
    """When the slot's next step is needed; a step that only ends the request, at once."""
    state: SpeechState = slot.state
    return state.due if state.clauses and state.due is not None else -math.inf
