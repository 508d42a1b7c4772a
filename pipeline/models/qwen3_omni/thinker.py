"""Thinker stage: prefill with the audio embeddings, then decode text, batched across requests.

Each new request is prefilled on its own (so its prompt logits are computed exactly as the
reference computes them); requests already prefilled decode together, one token per step, their KV
caches left-padded into one batch (``KVPool``). Every row carries explicit position ids (the text
row plus the three mrope rows; audio and text prompts get sequential positions), never the
module-level ``rope_deltas`` that ``generate`` keeps and that all requests would share.

Each step streams one chunk per request (to ``decode`` and ``talker``):

- ``token_id``: the new token; ``context_ids``: up to DETOK_CONTEXT tokens before it (the text
  decoder is stateless and needs them); ``token_embed``: its input embedding [hidden], which the
  talker projects into its text slot; ``last``: this is the thinker's final token (EOS or its cap).
- first chunk only, what the talker's prefill needs from the prompt: ``user_embeds`` [U, hidden]
  (for the rows of user turns: the hidden state of layer ``accept_hidden_layer`` at audio rows, the
  input embedding elsewhere), ``user_mm`` [U] (which rows are audio), ``assistant_embeds`` (the
  embeddings from the last ``<|im_start|>assistant`` to the end of the prompt) and ``tts_embeds``
  (embeddings of tts_bos, tts_eos, tts_pad).

Per-request state (ThinkerState in ``ARSlot.state``, KV in the runner's KVPool) lives from
``new_state`` to ``release``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from pipeline.models import StageContext
from pipeline.models.qwen3_omni import loading
from pipeline.models.qwen3_omni.detokenize import DETOK_CONTEXT
from pipeline.models.qwen3_omni.kv_pool import KVPool
from pipeline.models.qwen3_omni.sampling import Sampling, SamplingParams, pick_rows
from pipeline.proto import StagePayload
from pipeline.scheduling.base import ARSlot, ARStepResult, RequestError


@dataclass
class ThinkerState:
    input_ids: torch.Tensor
    audio_embeds: torch.Tensor | None
    sampling: Sampling
    tokens: list[int] = field(default_factory=list)
    position: int = 0
    prefilled: bool = False


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
        self.audio_token = thinker_cfg.audio_token_id
        self.mm_tokens = [thinker_cfg.audio_token_id, thinker_cfg.image_token_id, thinker_cfg.video_token_id]
        self.im_start = config.im_start_token_id
        self.user_token = config.user_token_id
        self.assistant_token = config.assistant_token_id
        self.tts_tokens = [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]
        self.accept_layer = config.talker_config.accept_hidden_layer
        self.max_positions = self.text_config.max_position_embeddings
        self.pool = KVPool()

    # -- ARRunner ----------------------------------------------------------------------------

    def new_state(self, payload: StagePayload) -> ThinkerState:
        rid, data = payload.request_id, payload.data
        ids = data["input_ids"]
        audio = data.get("audio_embeds")
        n_audio = int((ids == self.audio_token).sum())
        got = 0 if audio is None else audio.shape[0]
        if n_audio != got:
            raise RequestError(rid, f"prompt has {n_audio} audio tokens but {got} audio embeddings")
        if self._assistant_start(ids) is None:
            raise RequestError(rid, "prompt does not end with an assistant turn header")
        if ids.numel() >= self.max_positions:
            raise RequestError(rid, f"prompt of {ids.numel()} tokens exceeds {self.max_positions}")
        sampling = Sampling(sampling_params(payload.params), self.device)
        return ThinkerState(input_ids=ids, audio_embeds=audio if got else None, sampling=sampling)

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
        stopped = bool(st.tokens) and st.tokens[-1] == self.eos
        return {
            "context_ids": st.tokens[-DETOK_CONTEXT:],
            "finish_reason": "stop" if stopped else "length",
            "usage": {
                "prompt_tokens": int(st.input_ids.numel()),
                "completion_tokens": len(st.tokens),
                "total_tokens": int(st.input_ids.numel()) + len(st.tokens),
            },
        }

    def release(self, slot: ARSlot) -> None:
        self.pool.release(slot.request_id)
        slot.state = None

    # -- compute -----------------------------------------------------------------------------

    def _prefill(self, slot: ARSlot) -> ARStepResult:
        st: ThinkerState = slot.state
        ids = st.input_ids.to(self.device)[None]
        embeds = self.embed(ids)
        if st.audio_embeds is not None:
            mask = (ids == self.audio_token)[..., None].expand_as(embeds)
            embeds = embeds.masked_scatter(mask, st.audio_embeds.to(embeds.device, embeds.dtype))
        length = ids.shape[1]
        positions = torch.arange(length, device=self.device).view(1, 1, -1).expand(4, 1, -1)
        cache = DynamicCache(config=self.text_config)
        out = self.model.model.language_model(
            inputs_embeds=embeds,
            position_ids=positions,
            attention_mask=torch.ones(1, length, dtype=torch.long, device=self.device),
            cache=cache,
            use_cache=True,
            output_hidden_states=[self.accept_layer],
        )
        logits = self.model.lm_head(out.last_hidden_state[:, -1])
        token = pick_rows(logits, [st.sampling], [[]])[0]
        self.pool.add(slot.request_id, cache)
        st.prefilled, st.position, st.audio_embeds = True, length, None
        prompt = self._talker_prompt(ids[0], embeds[0], out.hidden_states[self.accept_layer][0])
        return self._emit(slot, token, self._embed_cpu([token])[0], prompt)

    def _decode(self, slots: list[ARSlot]) -> dict[str, ARStepResult]:
        by_id = {s.request_id: s for s in slots}
        rows = [by_id[rid] for rid in self.pool.arrange(list(by_id))]
        states: list[ThinkerState] = [s.state for s in rows]
        last = torch.tensor([[st.tokens[-1]] for st in states], device=self.device)
        positions = torch.tensor([st.position for st in states], device=self.device)
        out = self.model.model.language_model(
            inputs_embeds=self.embed(last),
            position_ids=positions.view(1, -1, 1).expand(4, -1, 1),
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
        data = {"token_id": token, "context_ids": context, "token_embed": embed, "last": last, **extra}
        return ARStepResult(data=data, finished=last)

    def _assistant_start(self, ids: torch.Tensor) -> int | None:
        starts = ((ids[:-1] == self.im_start) & (ids[1:] == self.assistant_token)).nonzero()
        return int(starts[-1]) if len(starts) else None

    def _talker_prompt(
        self, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """What the talker's prefill takes from the prompt, selected as the reference selects it."""
        n = ids.shape[0]
        positions = torch.arange(n, device=ids.device)
        im_start = torch.where(ids == self.im_start, positions, positions.new_full((), -1))
        previous = torch.cummax(im_start, dim=0).values.clamp_min(0)
        role = ids[(previous + 1).clamp_max(n - 1)]
        user = role == self.user_token
        mm = torch.isin(ids, torch.tensor(self.mm_tokens, device=ids.device))
        user_embeds = torch.where(mm[:, None], hidden, embeds)[user]
        start = self._assistant_start(ids)
        tts = self.embed(torch.tensor(self.tts_tokens, device=ids.device))
        return {
            "user_embeds": user_embeds.cpu(),
            "user_mm": mm[user].cpu(),
            "assistant_embeds": embeds[start:].cpu(),
            "tts_embeds": tts.cpu(),
        }
