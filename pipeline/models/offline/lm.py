"""The ``lm`` stage: a small instruction-tuned language model on onnxruntime-genai, streamed per token.

It is the text terminal: ``{"text": delta}`` per step (a token, or the tokens queued since the last
step); the same chunks stream to the ``tts`` stage.
(The user's words, ``input_transcript``, come from the ``asr`` stage, a terminal too.)

Each request decodes on its own thread with its own onnxruntime-genai generator (int8 weights,
``sources.py``), which puts every token on the request's queue; ``step`` starts the threads of new
requests and then takes, for every request of the batch, its next token and any others already
queued, so the requests of a batch decode side by side and a second caller's prefill does not
wait for a whole first answer. (onnxruntime-genai 0.18's Python binding holds the GIL while it
computes: the decoders take turns token by token, and the stage runs in a process of its own,
where no other stage's Python waits for them.) A step emits at least one token per request, so
the ``ar`` scheduler's step cap is never below the token count; the decoding thread stops at the
slot's cap itself.

A conversation's KV is kept between its requests (``lm_cache.py``; ``params["conversation_id"]``,
which the session sends where the preset keeps model state): a turn prefills only what its prompt
adds to the longest prefix the kept KV shares with it, ~20-60 tokens rather than the whole
history: the first token ~70-90 ms on the tenth turn as on the second. Measured on one core
(``evaluation/lm_runtime_bench.py``): ~3 ms a token of full prefill, 10-15 ms a decoded token,
where CTranslate2 int8 (the runtime before) took ~1.1 and 21-27 ms. ``usage.cached_tokens`` says
how many prompt tokens came from the cache.

Answers decoded side by side share the CPU with the ``tts`` stage: spoken answers start one at a
time, the next when the one before has had its first tokens, and a decoder past its first tokens
yields the CPU to other answers' first clauses and to synthesis (``pacing.py``, the stage's
``pace_after_tokens`` and ``pace_tokens_per_s`` options; 0 tokens a second: none of this).

A request that says what the answer is (``params["say"]``: the session's own lines, a check-in or
a closing line, which a small model asked to repeat would not) is answered with those words in one
step, nothing decoded: the ``tts`` stage speaks them as given.

An answer ends after the stage's ``max_sentences`` sentences (0: no limit), where a further one
begins (:func:`sentences_end`). A voice agent should answer in a sentence or two, and a small
model's instructions say so to no avail: SmolLM2 went on to 96 tokens of a list.

Per-request state: one ``Generation`` in the scheduler's ARSlot, from the request's arrival until
``release`` (end, failure or abort). Releasing sets the request's stop flag, which its thread reads
before each token and between pieces of its prefill (``PREFILL_PIECE`` tokens), so it stops within
one token or piece; its generator then goes back to the conversation's cache (or is freed).
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.models import StageContext
from pipeline.models.offline.lm_cache import PrefixCache
from pipeline.models.offline.pacing import Pacer, Ticket
from pipeline.models.offline.sources import GENAI_CONFIG, lm_source, onnxruntime_genai, prepare_lm
from pipeline.proto import StagePayload
from pipeline.scheduling.base import ARSlot, ARStepResult, RequestError
from pipeline.scheduling.conversation_book import SESSION_PARAM, Budget

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTIONS = (
    "You are a helpful voice assistant. Answer in one or two short sentences of plain spoken "
    "English, without lists or markup."
)
_TOKEN_TIMEOUT_S = 60.0  # a decoder that produced nothing for this long is broken, not slow
PREFILL_PIECE = 64  # prompt tokens prefilled at a time: a stop is read between pieces
KV_BYTES = 4  # float32 keys and values (the CPU int8 model's)
# A kept generator's memory per token of KV, counted against the budget: measured, the stage's RSS
# grew 2.2x its keys' and values' bytes over 20 kept conversations of 300 tokens (a generator
# holds its past and present KV), so they count twice.
KV_COPIES = 2
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


@dataclass(frozen=True)
class Step:
    """One decoded token; ``is_last``: the answer ends with it (an end token or the cap)."""

    token_id: int
    is_last: bool


@dataclass(eq=False)  # compared by identity: the runner finds it in its waiting list
class Generation:
    """One request's decoding: its prompt, the tokens its thread handed over, the text so far."""

    prompt: list[int]
    conversation: str | None = None  # whose kept KV it may continue (``params["conversation_id"]``)
    decoder: threading.Thread | None = None
    failure: Exception | None = None  # what ended the decoder, where something did
    steps: queue.SimpleQueue[Step] = field(default_factory=queue.SimpleQueue)
    stop: threading.Event = field(default_factory=threading.Event)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    ended: bool = False  # an end token came (rather than the cap)
    paced: bool = False  # its answer is spoken: its decoder keeps to the stage's pace
    said: str | None = None  # the words the answer must be (``params["say"]``): nothing is decoded
    ticket: Ticket | None = None  # its place in the pacer, from its start until it ends
    cached: int = 0  # prompt tokens the conversation's kept KV already held


class LanguageModel:
    """The ``lm`` stage's ARRunner."""

    def __init__(self, ctx: StageContext) -> None:
        from transformers import AutoTokenizer

        options = ctx.stage.options
        prepared = prepare_lm(lm_source(str(ctx.model_args.get("lm", "packaged"))))
        self._tokenizer = AutoTokenizer.from_pretrained(prepared.tokenizer_dir)
        if not self._tokenizer.chat_template:
            raise RuntimeError(
                f"the language model's tokenizer ({prepared.tokenizer_dir}) has no chat template"
            )
        og = onnxruntime_genai()
        config = og.Config(str(prepared.genai_dir))
        threads = {"intra_op_num_threads": ctx.stage.threads, "inter_op_num_threads": 1}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": threads}}}))
        self._og = og
        self._model = og.Model(config)
        self._instructions = str(options.get("default_instructions", DEFAULT_INSTRUCTIONS))
        self._max_prompt_tokens = int(options.get("max_prompt_tokens", 2048))
        self._max_length = self._max_prompt_tokens + ctx.stage.max_new_tokens
        self._repetition_penalty = float(options.get("repetition_penalty", 1.0))
        self._max_sentences = int(options.get("max_sentences", 0))
        self._pacer = Pacer(int(options.get("pace_after_tokens", 16)),
                            float(options.get("pace_tokens_per_s", 0)))
        eos = self._tokenizer.eos_token_id
        self._end_ids = [] if eos is None else [int(eos)]
        self._cache = PrefixCache(Budget.from_options(options), _token_bytes(prepared.genai_dir),
                                  self._max_length)
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
        conversation = payload.params.get(SESSION_PARAM)
        state = Generation(ids, None if conversation is None else str(conversation),
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
        if not state.paced or state.decoder is not None:
            return slot.input_closed
        return slot.input_closed and self._waiting[0] is state and self._pacer.idle()

    def output_cap(self, slot: ARSlot) -> int | None:
        return None

    def step(self, slots: list[ARSlot]) -> list[ARStepResult]:
        for slot in slots:
            if slot.state.decoder is None and slot.state.said is None:
                self._start(slot)  # every new request's decoder first: they decode side by side
        return [self._step_one(slot) for slot in slots]

    def _step_one(self, slot: ARSlot) -> ARStepResult:
        """The request's next token and the others its decoder has queued meanwhile."""
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
        if state.paced:
            self._waiting.remove(state)
            state.ticket = self._pacer.begin()
        state.decoder = threading.Thread(target=self._decode, args=(slot.request_id, state, slot.cap),
                                         name=f"lm-{slot.request_id}", daemon=True)
        state.decoder.start()

    def _decode(self, request_id: str, state: Generation, cap: int) -> None:
        """The request's thread: prefill what the kept KV lacks, then decode greedily up to
        ``cap`` tokens or an end token, each token onto the request's queue, until stopped. Its
        generator goes back to the conversation's cache at the end, whatever it holds."""
        generator, reused = None, 0
        if state.conversation is not None:
            generator, reused = self._cache.take(state.conversation, state.prompt, cap)
        try:
            if generator is None:
                generator = self._new_generator()
            state.cached = reused
            if reused:
                log.info("request %s: %d of %d prompt tokens from the conversation's kept KV",
                         request_id, reused, len(state.prompt))
            for at in range(reused, len(state.prompt), PREFILL_PIECE):
                if state.stop.is_set():
                    return
                generator.append_tokens(state.prompt[at : at + PREFILL_PIECE])
            count = 0
            while not state.stop.is_set():
                generator.generate_next_token()
                count += 1
                step = Step(int(generator.get_next_tokens()[0]), generator.is_done() or count >= cap)
                state.steps.put(step)
                if state.ticket is not None:
                    if step.is_last:
                        self._pacer.end(state.ticket)
                    else:
                        self._pacer.after_token(state.ticket, state.stop)
                if step.is_last:
                    break
        except Exception as err:  # noqa: BLE001 - the request fails with it (``_next_steps``)
            state.failure, generator = err, None
        finally:
            if state.conversation is not None:
                self._cache.put(state.conversation, generator)

    def _new_generator(self) -> Any:
        params = self._og.GeneratorParams(self._model)
        # A dynamic KV cache: memory grows with the tokens held, not with ``max_length``.
        params.set_search_options(max_length=self._max_length, do_sample=False,
                                  repetition_penalty=self._repetition_penalty,
                                  past_present_share_buffer=False)
        return self._og.Generator(self._model, params)

    def _next_steps(self, slot: ARSlot) -> list[Step]:
        """The request's next token from its decoder and those queued after it, up to its last;
        empty once it ended without one."""
        state: Generation = slot.state
        deadline = time.monotonic() + _TOKEN_TIMEOUT_S
        while True:
            try:
                steps = [state.steps.get(timeout=0.1)]
                break
            except queue.Empty:
                pass
            if state.decoder is not None and not state.decoder.is_alive():
                try:
                    steps = [state.steps.get_nowait()]  # put just before the decoder ended
                    break
                except queue.Empty:
                    pass
                if state.failure is not None:
                    raise RequestError(
                        slot.request_id, f"language model failed: {state.failure}"
                    ) from state.failure
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
                "cached_tokens": state.cached,
            },
        }

    def release(self, slot: ARSlot) -> None:
        state: Generation | None = slot.state
        if state is None:
            return
        state.stop.set()  # the decoder stops at its next token or prefill piece
        if state.ticket is not None:
            self._pacer.end(state.ticket)
        elif state in self._waiting:
            self._waiting.remove(state)  # released before its turn came
        slot.state = None

    # --- the ConversationCache protocol ---------------------------------------------------

    def cached_conversations(self) -> dict[str, int]:
        return self._cache.sizes()

    def drop_cached(self, conversation_id: str) -> None:
        self._cache.drop(conversation_id)


def _token_bytes(genai_dir: Any) -> int:
    """Bytes a kept generator holds per token of the model in ``genai_dir``: keys and values of
    every layer, ``KV_COPIES`` times."""
    decoder = json.loads((genai_dir / GENAI_CONFIG).read_text())["model"]["decoder"]
    per_layer = 2 * decoder["num_key_value_heads"] * decoder["head_size"] * KV_BYTES
    return KV_COPIES * decoder["num_hidden_layers"] * per_layer
