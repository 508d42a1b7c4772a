"""The ``lm`` stage: a small instruction-tuned language model on CTranslate2, streamed per token.

It is the text terminal: ``{"text": delta}`` per token; the same chunks stream to the ``tts`` stage.
(The user's words, ``input_transcript``, come from the ``asr`` stage, a terminal too.)

CTranslate2 decodes a request in its own worker thread (``generate_batch(asynchronous=True)``) and
hands each token to a callback, which puts it on the request's queue; ``step`` takes one token off
that queue, so one step is one token and the ``ar`` scheduler's cap counts tokens. CTranslate2 has
no continuous batching: the preset runs this stage with ``max_batch: 1``, so requests are answered
one after another (ample for one conversation on a 2-core machine).

Per-request state: one ``Generation`` in the scheduler's ARSlot, from the request's arrival until
``release`` (end, failure or abort). Releasing sets the request's stop flag, which the callback
returns to CTranslate2 at its next token, so the decoder stops within one token (a prefill in
progress finishes first) and its KV cache is freed with the job. No state is kept between requests:
the prompt is prefilled anew each turn (~0.1-0.2 s for a short conversation on one core), because
CTranslate2 offers prefix caching only for one static system prompt, not for a growing conversation.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.models import StageContext
from pipeline.models.offline.sources import lm_source, prepare_lm
from pipeline.proto import StagePayload
from pipeline.scheduling.base import ARSlot, ARStepResult, RequestError

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTIONS = (
    "You are a helpful voice assistant. Answer in one or two short sentences of plain spoken "
    "English, without lists or markup."
)
_TOKEN_TIMEOUT_S = 60.0  # a decoder that produced nothing for this long is broken, not slow


@dataclass
class Generation:
    """One request's decoding: its prompt, the tokens CTranslate2 handed over, the text so far."""

    prompt: list[str]
    job: Any = None
    steps: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    stop: threading.Event = field(default_factory=threading.Event)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    ended: bool = False  # an end token came (rather than the cap)


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
            inter_threads=1,
        )
        self._instructions = str(options.get("default_instructions", DEFAULT_INSTRUCTIONS))
        self._max_prompt_tokens = int(options.get("max_prompt_tokens", 2048))
        self._repetition_penalty = float(options.get("repetition_penalty", 1.0))
        eos = self._tokenizer.eos_token_id
        self._end_ids = [] if eos is None else [int(eos)]

    # --- prompt ---------------------------------------------------------------------------

    def new_state(self, payload: StagePayload) -> Generation:
        messages = payload.data.get("messages") or []
        if not messages:
            raise RequestError(payload.request_id, "no message to answer")
        ids = self._prompt_ids(payload.request_id, messages)
        log.info("request %s: prompt of %d tokens", payload.request_id, len(ids))
        return Generation(self._tokenizer.convert_ids_to_tokens(ids))

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
        return slot.input_closed

    def output_cap(self, slot: ARSlot) -> int | None:
        return None

    def step(self, slots: list[ARSlot]) -> list[ARStepResult]:
        return [self._step_one(slot) for slot in slots]

    def _step_one(self, slot: ARSlot) -> ARStepResult:
        state: Generation = slot.state
        if state.job is None:
            self._start(slot)
        step = self._next_step(slot)
        if step is None:
            return ARStepResult(None, finished=True)
        state.ids.append(int(step.token_id))
        state.ended = int(step.token_id) in self._end_ids
        text = self._tokenizer.decode(state.ids, skip_special_tokens=True)
        delta = ""
        if not text.endswith("\ufffd"):  # hold back a character whose bytes are not all here yet
            delta, state.text = text[len(state.text) :], text
        return ARStepResult({"text": delta} if delta else None, finished=bool(step.is_last))

    def _start(self, slot: ARSlot) -> None:
        state: Generation = slot.state
        steps, stop = state.steps, state.stop

        def on_token(step: Any) -> bool:  # CTranslate2's worker thread; True stops the decoder
            steps.put(step)
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

    def _next_step(self, slot: ARSlot) -> Any:
        """The request's next token from the decoder, or None once it ended without one."""
        state: Generation = slot.state
        deadline = time.monotonic() + _TOKEN_TIMEOUT_S
        while True:
            try:
                return state.steps.get(timeout=0.1)
            except queue.Empty:
                pass
            if state.job.done():
                try:
                    return state.steps.get_nowait()  # put just before the job ended
                except queue.Empty:
                    pass
                try:
                    state.job.result()
                except Exception as err:
                    raise RequestError(slot.request_id, f"language model failed: {err}") from err
                return None
            if time.monotonic() > deadline:
                raise RequestError(
                    slot.request_id, f"language model gave no token for {_TOKEN_TIMEOUT_S:.0f} s"
                )

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
        slot.state = None
