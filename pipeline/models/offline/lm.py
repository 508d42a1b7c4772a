"""The ``lm`` stage: a small instruction-tuned language model on CTranslate2, streamed per token.

It is the text terminal: ``{"text": delta}`` per step (a token, or the tokens queued since the last
step); the same chunks stream to the ``tts`` stage.
(The user's words, ``input_transcript``, come from the ``asr`` stage, a terminal too.)

CTranslate2 decodes a request in its own job (``generate_batch(asynchronous=True)``) and hands each
token to a callback, which puts it on the request's queue; ``step`` starts the jobs of new requests
and then takes, for every request of the batch, its next token and any others already queued. The
generator has one worker thread per slot of the stage's ``max_batch`` (``inter_threads``), so the
requests of a batch decode side by side: a second caller's prefill does not wait for a whole first
answer. True batching was measured and not taken: ``generate_batch`` over several prompts decodes
in lockstep, only requests that start together, and on this CPU took 2.4x as long for 4 short
questions as one after another, with a padded prompt's tokens differing from its answer alone. A
step emits at least one token per request, so the ``ar`` scheduler's step cap is never below the
token count; CTranslate2's own ``max_length`` (the slot's cap) bounds the tokens.

Answers decoded side by side share the CPU with the ``tts`` stage: spoken answers start one at a
time, the next when the one before has had its first tokens, and a decoder past its first tokens
yields the CPU to other answers' first clauses and to synthesis (``pacing.py``, the stage's
``pace_after_tokens`` and ``pace_tokens_per_s`` options; 0 tokens a second: none of this).

A request that says what the answer is (``params["say"]``: the session's own lines, a check-in or
a closing line, which a small model asked to repeat would not) is answered with those words in one
step, nothing decoded: the ``tts`` stage speaks them as given.

An answer ends after the stage's ``max_sentences`` sentences (0: no limit), where a further one
begins (:func:`sentences_end`). A voice agent should answer in a sentence or two, and a small
model's instructions say so to no avail: SmolLM2 went on to 96 tokens of a list. Every sentence
spoken is also prefilled again on each later turn (the conversation is prompted anew), so long
answers make every later first token later.

Per-request state: one ``Generation`` in the scheduler's ARSlot, from the request's arrival until
``release`` (end, failure or abort). Releasing sets the request's stop flag, which the callback
returns to CTranslate2 at its next token, so the decoder stops within one token (a prefill in
progress finishes first) and its KV cache is freed with the job. No state is kept between requests:
the prompt is prefilled anew each turn (~0.1-0.2 s for a short conversation on one core).
CTranslate2 caches a prefix only as a ``static_prompt`` (one system prompt, not a growing
conversation); measured with the preset's instructions it saved ~25% of a first turn's prefill but
changed one of four greedy answers, so it is not used.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.models import StageContext
from pipeline.models.offline.pacing import Pacer, Ticket
from pipeline.models.offline.sources import lm_source, prepare_lm
from pipeline.proto import StagePayload
from pipeline.scheduling.base import ARSlot, ARStepResult, RequestError

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTIONS = (
    "You are a helpful voice assistant. Answer in one or two short sentences of plain spoken "
    "English, without lists or markup."
)
_TOKEN_TIMEOUT_S = 60.0  # a decoder that produced nothing for this long is broken, not slow
# A sentence ends at . ? or ! (and closing quotes or brackets) where the next one has begun: a
# decimal point or a mark at the end of the text so far ends nothing yet.
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*(?=\s+\S)")
_LINE_BREAK = re.compile(r"[ \t]*\n\s*(?=\S)")


def sentences_end(text: str, max_sentences: int) -> int | None:
    """Where ``text`` ends after its first ``max_sentences`` sentences, once a further one has
    begun; None while it has no more than that (or for no limit, 0). A line break ends a sentence
    too (a list's items count one each), except after a colon: the line that opens a list runs on
    into its first item."""
    if max_sentences <= 0:
        return None
    ends = {m.end() for m in _SENTENCE_END.finditer(text)}
    ends |= {m.start() for m in _LINE_BREAK.finditer(text)
             if text[: m.start()].strip() and not text[: m.start()].endswith(":")}
    ordered = sorted(ends)
    return ordered[max_sentences - 1] if len(ordered) >= max_sentences else None


@dataclass(eq=False)  # compared by identity: the runner finds it in its waiting list
class Generation:
    """One request's decoding: its prompt, the tokens CTranslate2 handed over, the text so far."""

    prompt: list[str]
    job: Any = None
    steps: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    stop: threading.Event = field(default_factory=threading.Event)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    ended: bool = False  # an end token came (rather than the cap)
    paced: bool = False  # its answer is spoken: its decoder keeps to the stage's pace
    said: str | None = None  # the words the answer must be (``params["say"]``): nothing is decoded
    ticket: Ticket | None = None  # its place in the pacer, from its start until it ends


class LanguageModel:
    """The ``lm`` stage's ARRunner."""

    def __init__(self, ctx: StageContext) -> None:
        import ctranslate2
        from transformers import AutoTokenizer

        options = ctx.stage.options
        prepared = prepare_lm(
            lm_source(str(ctx.model_args.get("lm", "packaged"))),
            str(options.get("quantization", "int8")),
        )
        self._tokenizer = AutoTokenizer.from_pretrained(prepared.tokenizer_dir)
        if not self._tokenizer.chat_template:
            raise RuntimeError(
                f"the language model's tokenizer ({prepared.tokenizer_dir}) has no chat template"
            )
        self._generator = ctranslate2.Generator(
            str(prepared.model_dir),
            device="cpu",
            compute_type=str(options.get("compute_type", "int8")),
            intra_threads=ctx.stage.threads,
            inter_threads=ctx.stage.max_batch,  # one decoding job per request of a batch
        )
        self._instructions = str(options.get("default_instructions", DEFAULT_INSTRUCTIONS))
        self._max_prompt_tokens = int(options.get("max_prompt_tokens", 2048))
        self._repetition_penalty = float(options.get("repetition_penalty", 1.0))
        self._max_sentences = int(options.get("max_sentences", 0))
        self._pacer = Pacer(int(options.get("pace_after_tokens", 16)),
                            float(options.get("pace_tokens_per_s", 0)))
        eos = self._tokenizer.eos_token_id
        self._end_ids = [] if eos is None else [int(eos)]
        # Spoken answers not started yet, oldest first: each starts when the pacer is idle.
        self._waiting: list[Generation] = []

    # --- prompt ---------------------------------------------------------------------------

    def new_state(self, payload: StagePayload) -> Generation:
        messages = payload.data.get("messages") or []
        if not messages:
            raise RequestError(payload.request_id, "no message to answer")
        said = payload.params.get("say")
        if said is not None:
            log.info("request %s: says %d given characters", payload.request_id, len(str(said)))
            return Generation([], said=str(said))
        ids = self._prompt_ids(payload.request_id, messages)
        log.info("request %s: prompt of %d tokens", payload.request_id, len(ids))
        modalities = payload.params.get("modalities") or ["text", "audio"]
        state = Generation(self._tokenizer.convert_ids_to_tokens(ids),
                           paced="audio" in modalities and self._pacer.enabled)
        if state.paced:
            self._waiting.append(state)
        return state

    def _prompt_ids(self, rid: str, messages: list[dict[str, str]]) -> list[int]:
        """The chat template over the conversation, oldest turns dropped until it fits."""
        system = (
            "\n\n".join(m["text"] for m in messages if m["role"] == "system") or self._instructions
        )
        turns = [
            {"role": m["role"], "content": m["text"]} for m in messages if m["role"] != "system"
        ]
        if not turns:
            raise RequestError(rid, "no user or assistant message to answer")
        while True:
            text = self._render(system, turns)
            ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) <= self._max_prompt_tokens:
                return ids
            if len(turns) == 1:
                raise RequestError(
                    rid, f"the prompt has {len(ids)} tokens (max {self._max_prompt_tokens})"
                )
            turns = turns[1:]
            while len(turns) > 1 and turns[0]["role"] != "user":  # templates want a user first
                turns = turns[1:]

    def _render(self, system: str, turns: list[dict[str, str]]) -> str:
        """The chat template's text; for templates without a system role (they raise), the
        instructions open the first turn instead."""
        chat = [{"role": "system", "content": system}, *turns]
        try:
            return self._tokenizer.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=False
            )
        except Exception:  # noqa: BLE001 - jinja2's TemplateError, raised by the template itself
            first = {**turns[0], "content": f"{system}\n\n{turns[0]['content']}"}
            return self._tokenizer.apply_chat_template(
                [first, *turns[1:]], add_generation_prompt=True, tokenize=False
            )

    # --- the ARRunner protocol ------------------------------------------------------------

    def feed(self, slot: ARSlot, payload: StagePayload) -> None:
        raise RequestError(slot.request_id, "the language model takes no streamed input")

    def close_input(self, slot: ARSlot, payload: StagePayload) -> None:
        raise RequestError(slot.request_id, "the language model takes no streamed input")

    def runnable(self, slot: ARSlot) -> bool:
        """Started, or free to start: a spoken answer waits for its turn (module doc)."""
        state: Generation = slot.state
        if not state.paced or state.job is not None:
            return slot.input_closed
        return slot.input_closed and self._waiting[0] is state and self._pacer.idle()

    def output_cap(self, slot: ARSlot) -> int | None:
        return None

    def step(self, slots: list[ARSlot]) -> list[ARStepResult]:
        for slot in slots:
            if slot.state.job is None and slot.state.said is None:
                self._start(slot)  # every new request's job first: they decode side by side
        return [self._step_one(slot) for slot in slots]

    def _step_one(self, slot: ARSlot) -> ARStepResult:
        """The request's next token and the others its job has queued meanwhile."""
        state: Generation = slot.state
        if state.said is not None:  # the whole answer in one step, as given
            state.text, state.ended = state.said, True
            return ARStepResult({"text": state.said} if state.said else None, finished=True)
        steps = self._next_steps(slot)
        if not steps:
            return ARStepResult(None, finished=True)
        state.ids.extend(int(step.token_id) for step in steps)
        state.ended = int(steps[-1].token_id) in self._end_ids
        finished = bool(steps[-1].is_last)
        text = self._tokenizer.decode(state.ids, skip_special_tokens=True)
        cut = sentences_end(text, self._max_sentences)
        if cut is not None:  # a sentence past the limit began: the answer ends before it
            text, finished, state.ended = text[:cut], True, True
            state.stop.set()
        delta = ""
        if not text.endswith("\ufffd"):  # hold back a character whose bytes are not all here yet
            delta, state.text = text[len(state.text) :], text
        return ARStepResult({"text": delta} if delta else None, finished=finished)

    def _start(self, slot: ARSlot) -> None:
        state: Generation = slot.state
        steps, stop, pacer = state.steps, state.stop, self._pacer
        ticket = None
        if state.paced:
            self._waiting.remove(state)
            ticket = state.ticket = pacer.begin()

        def on_token(step: Any) -> bool:  # CTranslate2's worker thread; True stops the decoder
            steps.put(step)
            if ticket is not None:
                if step.is_last:
                    pacer.end(ticket)
                else:
                    pacer.after_token(ticket, stop)
            return stop.is_set()

        state.job = self._generator.generate_batch(
            [state.prompt],
            asynchronous=True,
            beam_size=1,
            sampling_topk=1,
            max_length=slot.cap,
            end_token=self._end_ids or None,
            include_prompt_in_result=False,
            repetition_penalty=self._repetition_penalty,
            callback=on_token,
        )[0]

    def _next_steps(self, slot: ARSlot) -> list[Any]:
        """The request's next token from the decoder and those queued after it, up to its last;
        empty once it ended without one."""
        state: Generation = slot.state
        deadline = time.monotonic() + _TOKEN_TIMEOUT_S
        while True:
            try:
                steps = [state.steps.get(timeout=0.1)]
                break
            except queue.Empty:
                pass
            if state.job.done():
                try:
                    steps = [state.steps.get_nowait()]  # put just before the job ended
                    break
                except queue.Empty:
                    pass
                try:
                    state.job.result()
                except Exception as err:
                    raise RequestError(slot.request_id, f"language model failed: {err}") from err
                return []
            if time.monotonic() > deadline:
                raise RequestError(
                    slot.request_id, f"language model gave no token for {_TOKEN_TIMEOUT_S:.0f} s"
                )
        while not steps[-1].is_last:
            try:
                steps.append(state.steps.get_nowait())
            except queue.Empty:
                break
        return steps

    def finish(self, slot: ARSlot, capped: bool) -> dict[str, Any] | None:
        state: Generation = slot.state
        return {
            "finish_reason": "stop" if state.ended else "length",
            "usage": {
                "prompt_tokens": len(state.prompt),
                "completion_tokens": len(state.ids),
                "total_tokens": len(state.prompt) + len(state.ids),
            },
        }

    def release(self, slot: ARSlot) -> None:
        state: Generation | None = slot.state
        if state is None:
            return
        state.stop.set()  # the decoder stops at its next token and frees its cache
        if state.ticket is not None:
            self._pacer.end(state.ticket)
        elif state in self._waiting:
            self._waiting.remove(state)  # released before its turn came
        slot.state = None
