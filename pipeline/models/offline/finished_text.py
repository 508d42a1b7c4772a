"""Whether the user's words so far read as a finished turn: a small language model's judgement.

semantic_vad hears intonation in the session (``duplex.turns.end_of_turn``); the words are read
here, in the pipeline, after the recogniser that wrote them down, and the probability travels back
with the transcript as ``input_end_of_turn`` for the session's turn detector to combine with what
it heard. Only requests that ask (``params["end_of_turn"]``: semantic_vad's speculative answer,
begun at a pause of a turn that may go on) are judged.

Two places judge: the offline model set's ``judge`` stage (:class:`TurnJudge`), fed by the ``asr``
stage at the same moment as the ``lm`` stage, so that the judgement runs beside the answer's
prefill instead of before it; and Qwen3-Omni's ``transcribe`` stage, where its ``finished_text``
option names a model (:func:`finished_text_judge`, :func:`judged`).

The judge is a causal language model (the offline preset's SmolLM2-135M-Instruct, on CTranslate2
int8): given the conversation's last assistant words, if any, and the user's words so far in the
model's chat template, how likely is the user's message to end here? That is the probability of
the tokens that end a message at the next position: the template's end-of-turn token and the
sentence-final marks ``.``, ``?`` and ``!``. The transcript is read lowercased and without
punctuation, since Whisper writes a full stop after a mid-sentence pause as readily as after a
finished sentence; the model then judges the words alone ("i want to fly from boston to" 0.001,
"what is the capital of australia" 0.78). Numbers read in groups stay doubtful either way ("call
me at 617 555" 0.004, "... 555 2368" 0.09): that is what the policy's maximum wait is for.

Not fine-tuned for the task: the model's own sense of where English sentences end. On the
evaluation set (``python -m evaluation.turn_eval``) it separates finished turns from mid-sentence
pauses with an AUC of ~0.85 on Whisper's transcripts of espeak-ng speech.

Cost: one forward pass over the prompt (~20-40 tokens), ~20 ms on one core (~40-60 ms in a call,
beside the other stages). One :class:`FinishedText` per stage runner, used by its one worker
thread; a generator of its own, so that it never waits behind the ``lm`` stage's decoding in the
same process.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from pipeline.models import StageContext
from pipeline.models.offline.sources import lm_source, prepare_lm
from pipeline.scheduling.base import BatchItem

log = logging.getLogger(__name__)

_SENTINEL = "\x00USER\x00"  # where the user's words go in the rendered template
_NOT_A_WORD = re.compile(r"[^\w\s']+")
_SENTENCE_ENDS = (".", "?", "!")
MAX_CONTEXT_CHARS = 400  # of the last assistant message: its end is what the user answers


class FinishedText:
    """P(the user's message ends with these words), from a causal language model (module doc)."""

    def __init__(self, choice: str = "packaged", threads: int = 1) -> None:
        import ctranslate2
        from transformers import AutoTokenizer

        prepared = prepare_lm(lm_source(choice))
        self._tokenizer = AutoTokenizer.from_pretrained(prepared.tokenizer_dir)
        self._generator = ctranslate2.Generator(
            str(prepared.ct2_dir), device="cpu", compute_type="int8", intra_threads=threads,
            inter_threads=1,
        )
        vocab = self._tokenizer.get_vocab()
        ends = [vocab[mark] for mark in _SENTENCE_ENDS if mark in vocab]
        if self._tokenizer.eos_token_id is not None:
            ends.append(int(self._tokenizer.eos_token_id))
        if not ends:
            raise RuntimeError(f"{prepared.tokenizer_dir}: no token ends a message")
        self._ends = np.array(sorted(set(ends)))
        log.info("text end-of-turn judge loaded from %s", prepared.ct2_dir)

    def probability(self, transcript: str, context: str | None = None) -> float:
        """P(finished) for the user's ``transcript`` so far, after the assistant's ``context``
        (its last message's text; None at the start of a conversation)."""
        words = " ".join(_NOT_A_WORD.sub(" ", transcript.lower()).split())
        if not words:
            return 0.0
        ids = self._tokenizer(self._prompt(context) + words, add_special_tokens=False)["input_ids"]
        tokens = self._tokenizer.convert_ids_to_tokens(ids)
        logits = np.asarray(self._generator.forward_batch([tokens]))[0, -1].astype(np.float64)
        odds = np.exp(logits - logits.max())
        return float(odds[self._ends].sum() / odds.sum())

    def _prompt(self, context: str | None) -> str:
        """The chat template up to where the user's words begin. An empty system message keeps
        out a template's default one (SmolLM2's is 20 tokens nobody needs here)."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": ""}]
        if context:
            messages.append({"role": "assistant", "content": context[-MAX_CONTEXT_CHARS:]})
        messages.append({"role": "user", "content": _SENTINEL})
        rendered = self._tokenizer.apply_chat_template(messages, tokenize=False)
        return rendered[: rendered.index(_SENTINEL)]


def finished_text_judge(ctx: StageContext) -> FinishedText | None:
    """The stage's judge, where its ``finished_text`` option names a language model
    (``packaged``, a GGUF file or a Hugging Face folder: as the offline ``lm``'s)."""
    choice = ctx.stage.options.get("finished_text")
    return None if choice is None else FinishedText(str(choice))


def judged(params: dict[str, Any], judge: FinishedText | None, transcript: str,
           context: str | None) -> dict[str, float]:
    """``{"input_end_of_turn": P(finished)}`` for a request that asks (module doc) where there is
    a judge; ``{}`` otherwise."""
    if judge is None or not params.get("end_of_turn"):
        return {}
    return {"input_end_of_turn": judge.probability(transcript, context)}


class TurnJudge:
    """BatchRunner of the offline model set's ``judge`` stage: for each item of the ``asr`` stage,
    the user's transcript (where the turn came as audio) and, where the request asks, the
    judgement of its words after the assistant's last message (``"Yes."`` ends a turn after a
    question). Stateless (``simple`` scheduler)."""

    def __init__(self, ctx: StageContext) -> None:
        self._judge = FinishedText(str(ctx.stage.options.get("finished_text", "packaged")),
                                   threads=ctx.stage.threads)

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        return [self._one(item.payload.data, item.payload.params) for item in batch]

    def _one(self, data: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        transcript = data.get("input_transcript")
        if transcript is None:  # the turn came as text: nothing to report
            return {}
        messages = data.get("messages") or []
        context = next((m["text"] for m in reversed(messages[:-1]) if m["role"] == "assistant"),
                       None)
        return {"input_transcript": transcript,
                **judged(params, self._judge, str(transcript), context)}
