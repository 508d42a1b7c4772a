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

piper-tts is GPL-3.0 and an optional extra: without it, building this stage fails with an error
that names the extra to install.
"""

from __future__ import annotations

import json
import logging
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
    speak: bool
    splitter: ClauseSplitter
    clauses: deque[str] = field(default_factory=deque)
    voiced: int = 0


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

    def new_state(self, payload: StagePayload) -> SpeechState:
        modalities = payload.params.get("modalities") or ["text", "audio"]
        return SpeechState("audio" in modalities, ClauseSplitter(self._min_chars, self._max_chars))

    def feed(self, slot: ARSlot, payload: StagePayload) -> None:
        state: SpeechState = slot.state
        text = payload.data.get("text")
        if state.speak and text:
            state.clauses.extend(state.splitter.push(text))

    def close_input(self, slot: ARSlot, payload: StagePayload) -> None:
        state: SpeechState = slot.state
        if state.speak:
            state.clauses.extend(state.splitter.flush())

    def runnable(self, slot: ARSlot) -> bool:
        return bool(slot.state.clauses) or slot.input_closed

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
        slot.state = None
