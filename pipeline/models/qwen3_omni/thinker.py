"""Thinker stage: prefill with the audio, image and video embeddings, then decode text, batched
across requests.

Its input is ``mm_aggregate``'s (``aggregate.py``): the prompt ids, the embeddings of its audio,
image and video placeholders in their order (``mm_embeds``), and with images or video the deepstack
features (added to the hidden states of the first layers at the image and video rows, as the
reference adds them) and the prompt's 3-D rope positions. Each new request is prefilled on its own (so its prompt logits are
computed exactly as the reference computes them); requests already prefilled decode together, one
token per step, their KV caches left-padded into one batch (``KVPool``). Every row carries
explicit position ids (the text row, its index, plus the three mrope rows: see ``rope.py``; audio
and text prompts get sequential positions), never the module-level ``rope_deltas`` that
``generate`` keeps and that all requests would share.

Each step streams one chunk per request (to ``decode`` and ``talker``):

- ``token_id``: the new token; ``context_ids``: up to DETOK_CONTEXT tokens before it (the text
  decoder is stateless and needs them); ``token_embed``: its input embedding [hidden], which the
  talker projects into its text slot; ``last``: this is the thinker's final token (EOS or its cap).
- requests that offer tools (``tools.py``): ``parsed``, this token's words and call piece
  (``{"text", "function_call"}``, see ``call_parser.py``; the ``decode`` stage passes them on);
  ``settled``: how many answer tokens are known to be words (text that may open a call is not,
  until it is known); ``call_from``: once a call has begun, the answer token where its text starts
  (the talker voices the tokens before it, and nothing from there on). The answer ends at the
  first call's ``</tool_call>``, as at EOS; the final data adds the last ``parsed``.
- first chunk only, what the talker's prefill needs from the prompt: ``user_embeds`` [U, hidden]
  (for the rows of user turns: the hidden state of layer ``accept_hidden_layer`` at audio and image
  rows, the input embedding elsewhere), ``user_mm`` [U] (which rows are audio or images),
  ``user_pos`` [3, U] (the talker's rope positions of those rows), ``assistant_embeds`` (the
  embeddings from the last ``<|im_start|>assistant`` to the end of the prompt) and ``tts_embeds``
  (embeddings of tts_bos, tts_eos, tts_pad).

Per-request state (ThinkerState in ``ARSlot.state``, KV in the runner's KVPool, the call parser of
a request with tools) lives from ``new_state`` to ``release``.

Conversations (ConversationRunner): a request that names a conversation may leave its state for
the next one (``keep`` -> ``KeptThinker``, see ``kept.py``); the next request's input holds only
its new messages, rendered by the same chat template, and ``resume`` prefills just those after the
kept tokens (the last answer's final token, which has no KV yet, and ``<|im_end|>`` if the answer
was cut, then ``\n``), at the positions that follow: the same tokens at the same positions as a
fresh request over the whole history, so the same answer.

A turn prefilled while the user speaks (``conversation_book.py``): a partial request
(``params["prefill_until_s"]``) prefills its piece of the user's turn, samples nothing and ends at
once, its final data carrying the conversation's user rows so far for the talker; its kept state
is open (``kept.py``), and the next request continues inside that turn (no ``<|im_end|>`` joins
them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from pipeline.models import StageContext
from pipeline.models.qwen3_omni import loading, tools
from pipeline.models.qwen3_omni.call_parser import CallParser, Parsed
from pipeline.models.qwen3_omni.detokenize import DETOK_CONTEXT, TokenText
from pipeline.models.qwen3_omni.kept import KeptThinker, cut
from pipeline.models.qwen3_omni.kv_pool import KVPool
from pipeline.models.qwen3_omni.rope import user_positions
from pipeline.models.qwen3_omni.sampling import Sampling, SamplingParams, pick_rows
from pipeline.proto import StagePayload
from pipeline.scheduling.base import ARSlot, ARStepResult, RequestError
from pipeline.scheduling.conversation_book import partial_until


@dataclass
class ThinkerState:
    input_ids: torch.Tensor
    """What the prefill feeds: the whole prompt, or (continuing ``past``) what is new."""
    mm_embeds: torch.Tensor | None
    """The embeddings of this request's audio and image placeholders, in order, until its prefill."""
    deepstack: torch.Tensor | None
    """[layers, image placeholders, hidden] with images, until the prefill."""
    positions: torch.Tensor | None
    """The 3-D rope positions [3, n] of this request's own prompt (relative) with images, until
    the prefill."""
    sampling: Sampling
    tokens: list[int] = field(default_factory=list)
    position: int = 0
    """The rope position of the next row fed."""
    delta: int = 0
    """``position`` minus the next row's index (non-zero after images), from the prefill on."""
    prefilled: bool = False
    past: KeptThinker | None = None
    """The conversation state this request continues, until its prefill takes the cache over."""
    new_from: int = 0
    """Where this request's own prompt (the preprocessed ids, with their audio) starts in input_ids."""
    prompt_ids: torch.Tensor | None = None
    """Every prompt token (the conversation's and this request's), from the prefill on (CPU)."""
    user_embeds: torch.Tensor | None = None
    user_mm: torch.Tensor | None = None
    user_pos: torch.Tensor | None = None
    base: int = 0
    base_users: int = 0
    base_delta: int = 0
    base_open: bool = False
    turn_base: int = 0
    turn_users: int = 0
    turn_delta: int = 0
    partial: bool = False
    """A piece of the user's turn, prefilled while they speak: no answer."""
    calls: CallParser | None = None
    """The answer split into words and a function call, for requests that offer tools."""
    settled: int = 0
    """Answer tokens known to be words (with ``calls``)."""
    call_from: int | None = None
    """The answer token where a call's text starts, once one has begun (with ``calls``)."""


def sampling_params(params: dict[str, Any]) -> SamplingParams:
    """Greedy unless the request asks for a positive ``temperature``."""
    temperature = params.get("temperature")
    if not temperature:
        return SamplingParams()
    return SamplingParams(
        do_sample=True,
        temperature=float(temperature),
        top_k=int(params.get("top_k") or 0),
        top_p=float(params.get("top_p") or 1.0),
        seed=params.get("seed"),
    )


class Thinker:
    """ARRunner for the ``thinker`` stage."""

    def __init__(self, ctx: StageContext) -> None:
        source = loading.resolve(ctx.model_args)
        self.device = ctx.stage.device
        self.model = loading.load_thinker(source, self.device)
        self.embed = self.model.get_input_embeddings()
        config = loading.load_config(source.path)
        thinker_cfg = config.thinker_config
        self.text_config = thinker_cfg.text_config
        self.eos = config.im_end_token_id
        self.im_end = config.im_end_token_id
        """What closes a message in the chat template (``eos`` is the token that stops decoding)."""
        self.image_token = thinker_cfg.image_token_id
        self.mm_tokens = [thinker_cfg.audio_token_id, thinker_cfg.image_token_id, thinker_cfg.video_token_id]
        self.placeholders = torch.tensor(self.mm_tokens)
        self.visual = torch.tensor([thinker_cfg.image_token_id, thinker_cfg.video_token_id])
        self.im_start = config.im_start_token_id
        self.user_token = config.user_token_id
        self.assistant_token = config.assistant_token_id
        self.tts_tokens = [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]
        self.accept_layer = config.talker_config.accept_hidden_layer
        self.max_positions = self.text_config.max_position_embeddings
        self.pool = KVPool()
        tokenizer = loading.load_tokenizer(source.path)
        self.newline = tokenizer.encode("\n")
        # Requests with tools need the answer's text here: the call parser keeps per-request state,
        # which the stateless decode stage cannot.
        self.token_text = TokenText(tokenizer)

    # -- ARRunner ----------------------------------------------------------------------------

    def new_state(self, payload: StagePayload) -> ThinkerState:
        return self._state(payload, None)

    def _state(self, payload: StagePayload, past: KeptThinker | None) -> ThinkerState:
        rid, data = payload.request_id, payload.data
        ids = data["input_ids"]
        mm = data.get("mm_embeds")
        n_mm = int(torch.isin(ids, self.placeholders).sum())
        got = 0 if mm is None else mm.shape[0]
        if n_mm != got:
            raise RequestError(rid, f"prompt has {n_mm} audio, image and video placeholders but {got} embeddings")
        partial = bool(partial_until(payload.params))
        if not partial and self._assistant_start(ids) is None:
            raise RequestError(rid, "prompt does not end with an assistant turn header")
        sampling = Sampling(sampling_params(payload.params), self.device)
        try:
            offered = bool(tools.offered(payload.params))
            calls = CallParser(tools.call_opening(payload.params) or "") if offered else None
        except tools.ToolsError as err:
            raise RequestError(rid, str(err)) from None
        before = torch.zeros(0, dtype=ids.dtype)
        if past is not None:
            # An answer cut short (barge-in, cap) never got its <|im_end|>; the template's is added.
            # An open turn goes on where its last piece ended.
            ended = past.open or (past.ids.numel() > 0 and int(past.ids[-1]) == self.im_end)
            joiner = ([] if ended else [self.im_end]) + ([] if past.open else self.newline)
            before = torch.cat([past.ids[past.cached:], torch.tensor(joiner, dtype=ids.dtype)])
        total = (0 if past is None else past.cached) + before.numel() + ids.numel()
        if total >= self.max_positions:
            raise RequestError(rid, f"prompt of {total} tokens exceeds {self.max_positions}")
        return ThinkerState(
            input_ids=torch.cat([before, ids]) if past is not None else ids,
            mm_embeds=mm if got else None,
            deepstack=data.get("deepstack"),
            positions=data.get("positions"),
            sampling=sampling,
            past=past,
            new_from=before.numel(),
            partial=partial,
            calls=calls,
        )

    # -- ConversationRunner --------------------------------------------------------------------

    def resume(self, kept: KeptThinker, payload: StagePayload) -> ThinkerState:
        return self._state(payload, kept)

    def started(self, slot: ARSlot) -> bool:
        return slot.state.prefilled

    def keep(self, slot: ARSlot) -> KeptThinker | None:
        st: ThinkerState = slot.state
        if not st.prefilled:
            past, st.past = st.past, None
            return past
        cache = self.pool.take(slot.request_id)
        assert st.prompt_ids is not None and st.user_embeds is not None and st.user_mm is not None
        return KeptThinker(
            ids=torch.cat([st.prompt_ids, torch.tensor(st.tokens, dtype=st.prompt_ids.dtype)]),
            cache=cache,
            user_embeds=st.user_embeds,
            user_mm=st.user_mm,
            user_pos=st.user_pos,
            base=st.base,
            base_users=st.base_users,
            answer_start=st.prompt_ids.numel(),
            open=st.partial,
            base_open=st.base_open,
            turn_base=st.turn_base,
            turn_users=st.turn_users,
            delta=st.delta,
            base_delta=st.base_delta,
            turn_delta=st.turn_delta,
        )

    def truncate(self, kept: KeptThinker | None, answer_tokens: int | None) -> KeptThinker | None:
        return None if kept is None else cut(kept, answer_tokens)

    def kept_bytes(self, kept: KeptThinker) -> int:
        return kept.nbytes()

    def drop(self, kept: KeptThinker) -> None:
        kept.cache = DynamicCache()  # the tensors go now, whoever still holds the object

    def feed(self, slot: ARSlot, payload: StagePayload) -> None:
        raise RuntimeError("the thinker takes whole inputs, not streams")

    def close_input(self, slot: ARSlot, payload: StagePayload) -> None:
        raise RuntimeError("the thinker takes whole inputs, not streams")

    def runnable(self, slot: ARSlot) -> bool:
        return True

    def output_cap(self, slot: ARSlot) -> int | None:
        return None

    @torch.inference_mode()
    def step(self, slots: list[ARSlot]) -> list[ARStepResult]:
        results: dict[str, ARStepResult] = {}
        for slot in slots:
            if not slot.state.prefilled:
                results[slot.request_id] = self._prefill(slot)
        decoding = [s for s in slots if s.request_id not in results]
        if decoding:
            results.update(self._decode(decoding))
        return [results[s.request_id] for s in slots]

    def finish(self, slot: ARSlot, capped: bool) -> dict[str, Any] | None:
        st: ThinkerState = slot.state
        context = st.tokens[-DETOK_CONTEXT:]
        called = st.calls is not None and st.calls.closed
        stopped = bool(st.tokens) and (st.tokens[-1] == self.eos or called)
        prompt = int(st.prompt_ids.numel()) if st.prompt_ids is not None else int(st.input_ids.numel())
        data: dict[str, Any] = {
            "context_ids": context,
            "finish_reason": "stop" if stopped else "length",
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": len(st.tokens),
                "total_tokens": prompt + len(st.tokens),
            },
        }
        if st.calls is not None:
            # The bytes of an unfinished character, then whatever was held back or left open.
            last = st.calls.feed(self.token_text.flush(context)).then(st.calls.close())
            data["parsed"] = last.as_data()
        if st.partial and st.user_embeds is not None:  # the talker caches the user rows so far
            data["user_embeds"], data["user_mm"], data["user_pos"] = st.user_embeds, st.user_mm, st.user_pos
        return data

    def release(self, slot: ARSlot) -> None:
        self.pool.release(slot.request_id)
        if slot.state is not None and slot.state.past is not None:
            self.drop(slot.state.past)  # released while still holding the state it continued
        slot.state = None

    # -- compute -----------------------------------------------------------------------------

    def _prefill(self, slot: ARSlot) -> ARStepResult:
        st: ThinkerState = slot.state
        past, st.past = st.past, None
        start = 0 if past is None else past.cached
        ids = st.input_ids.to(self.device)[None]
        embeds = self.embed(ids)
        own = torch.zeros_like(ids, dtype=torch.bool)
        own[:, st.new_from:] = True  # audio and images are only in this request's own prompt
        if st.mm_embeds is not None:
            mask = (torch.isin(ids, self.placeholders.to(ids.device)) & own)[..., None].expand_as(embeds)
            embeds = embeds.masked_scatter(mask, st.mm_embeds.to(embeds.device, embeds.dtype))
        end = start + ids.shape[1]
        rope = self._rope(st, start, 0 if past is None else past.delta)
        deep: dict[str, Any] = {}
        if st.deepstack is not None and st.deepstack.shape[1]:
            deep["visual_pos_masks"] = torch.isin(ids, self.visual.to(ids.device)) & own
            deep["deepstack_visual_embeds"] = list(st.deepstack.to(embeds.device, embeds.dtype))
        cache = DynamicCache(config=self.text_config) if past is None else past.cache
        out = self.model.model.language_model(
            inputs_embeds=embeds,
            position_ids=torch.cat([torch.arange(start, end, device=self.device)[None], rope])[:, None],
            attention_mask=torch.ones(1, end, dtype=torch.long, device=self.device),
            cache=cache,
            use_cache=True,
            output_hidden_states=[self.accept_layer],
            **deep,
        )
        self.pool.add(slot.request_id, cache)
        st.prefilled, st.mm_embeds, st.deepstack, st.positions = True, None, None, None
        st.position = int(rope.max()) + 1
        st.delta = st.position - end
        st.prompt_ids = st.input_ids if past is None else torch.cat([past.ids[:start], st.input_ids])
        if past is not None and st.partial and past.open:
            st.base, st.base_users = past.base, past.base_users  # the same turn: undone as one
            st.base_delta = past.base_delta
        elif past is not None:
            st.base, st.base_users, st.base_delta = past.ids.numel(), past.user_mm.numel(), past.delta
            st.base_open, st.turn_base, st.turn_users = past.open, past.base, past.base_users
            st.turn_delta = past.base_delta
        prompt = self._talker_prompt(
            st.prompt_ids.to(self.device), start, embeds[0], out.hidden_states[self.accept_layer][0],
            with_answer=not st.partial,
        )
        user = prompt.pop("user")
        st.user_embeds, st.user_mm = prompt["user_embeds"], prompt["user_mm"]
        top = -1 if past is None or not past.user_pos.numel() else int(past.user_pos.max())
        st.user_pos = user_positions(rope.cpu(), user.cpu(), top)
        if past is not None:
            st.user_embeds = torch.cat([past.user_embeds, st.user_embeds])
            st.user_mm = torch.cat([past.user_mm, st.user_mm])
            st.user_pos = torch.cat([past.user_pos, st.user_pos], dim=1)
        prompt["user_embeds"], prompt["user_mm"], prompt["user_pos"] = st.user_embeds, st.user_mm, st.user_pos
        if st.partial:
            return ARStepResult(data=None, finished=True)
        logits = self.model.lm_head(out.last_hidden_state[:, -1])
        token = pick_rows(logits, [st.sampling], [[]])[0]
        return self._emit(slot, token, self._embed_cpu([token])[0], prompt)

    def _rope(self, st: ThinkerState, start: int, delta: int) -> torch.Tensor:
        """The mrope positions [3, n] of the rows ``st.input_ids`` fed after ``start`` cached rows,
        whose next position is ``start + delta``: each row's index plus ``delta``, except the own
        prompt's rows when it has images (their positions from ``mm_aggregate``, moved to start
        where that prompt starts)."""
        n = st.input_ids.numel()
        rope = torch.arange(start + delta, start + delta + n, device=self.device).expand(3, -1).clone()
        if st.positions is not None:
            rope[:, st.new_from:] = st.positions.to(self.device) + start + delta + st.new_from
        return rope

    def _decode(self, slots: list[ARSlot]) -> dict[str, ARStepResult]:
        by_id = {s.request_id: s for s in slots}
        rows = [by_id[rid] for rid in self.pool.arrange(list(by_id))]
        states: list[ThinkerState] = [s.state for s in rows]
        last = torch.tensor([[st.tokens[-1]] for st in states], device=self.device)
        rope = torch.tensor([st.position for st in states], device=self.device)
        index = torch.tensor([st.position - st.delta for st in states], device=self.device)
        out = self.model.model.language_model(
            inputs_embeds=self.embed(last),
            position_ids=torch.cat([index[None], rope.expand(3, -1)])[..., None],
            attention_mask=self.pool.attention_mask(),
            cache=self.pool.batch_cache(),
            use_cache=True,
        )
        logits = self.model.lm_head(out.last_hidden_state[:, -1])
        tokens = pick_rows(logits, [st.sampling for st in states], [st.tokens for st in states])
        results = {}
        for slot, token, embed in zip(rows, tokens, self._embed_cpu(tokens)):
            slot.state.position += 1
            results[slot.request_id] = self._emit(slot, token, embed, {})
        return results

    def _embed_cpu(self, tokens: list[int]) -> torch.Tensor:
        return self.embed(torch.tensor(tokens, device=self.device)).cpu()

    def _emit(
        self, slot: ARSlot, token: int, embed: torch.Tensor, extra: dict[str, Any]
    ) -> ARStepResult:
        st: ThinkerState = slot.state
        context = st.tokens[-DETOK_CONTEXT:]
        st.tokens.append(token)
        # The talker must know which token is the thinker's last (it is voiced as tts_eos, never as
        # text), so the runner ends the request itself at EOS or at the cap rather than leave the
        # cap to the scheduler.
        last = token == self.eos or slot.steps + 1 >= slot.cap
        data = {"token_id": token, "context_ids": context, "token_embed": embed, **extra}
        if st.calls is not None:
            parsed: Parsed = st.calls.feed(self.token_text.delta(context, token))
            data["parsed"] = parsed.as_data()
            if st.calls.in_call:
                # The call's text began at the first token not yet settled as words.
                st.call_from = st.settled if st.call_from is None else st.call_from
            elif not st.calls.holding:
                st.settled = len(st.tokens)
            data["settled"], data["call_from"] = st.settled, st.call_from
            last = last or st.calls.closed  # one call per answer (call_parser.py)
        data["last"] = last
        return ARStepResult(data=data, finished=last)

    def _assistant_start(self, ids: torch.Tensor) -> int | None:
        starts = ((ids[:-1] == self.im_start) & (ids[1:] == self.assistant_token)).nonzero()
        return int(starts[-1]) if len(starts) else None

    def _talker_prompt(
        self, ids: torch.Tensor, start: int, embeds: torch.Tensor, hidden: torch.Tensor,
        with_answer: bool,
    ) -> dict[str, torch.Tensor]:
        """What the talker's prefill takes from the rows ``ids[start:]`` just prefilled (``embeds``,
        ``hidden``), selected as the reference selects it from the whole prompt ``ids``; the rows
        of user turns only where no answer follows (a piece of a turn). ``user`` marks those rows."""
        n = ids.shape[0]
        positions = torch.arange(n, device=ids.device)
        im_start = torch.where(ids == self.im_start, positions, positions.new_full((), -1))
        previous = torch.cummax(im_start, dim=0).values.clamp_min(0)
        role = ids[(previous + 1).clamp_max(n - 1)][start:]
        user = role == self.user_token
        mm = torch.isin(ids[start:], torch.tensor(self.mm_tokens, device=ids.device))
        user_embeds = torch.where(mm[:, None], hidden, embeds)[user]
        if not with_answer:
            return {"user_embeds": user_embeds.cpu(), "user_mm": mm[user].cpu(), "user": user}
        header = self._assistant_start(ids) - start
        tts = self.embed(torch.tensor(self.tts_tokens, device=ids.device))
        return {
            "user": user,
            "user_embeds": user_embeds.cpu(),
            "user_mm": mm[user].cpu(),
            "assistant_embeds": embeds[header:].cpu(),
            "tts_embeds": tts.cpu(),
        }
