"""Talker stage: codec frames from the thinker's stream, exactly as the reference builds them.

Fed by the thinker's chunks (see ``thinker.py``). Let X be the text the talker voices: the prompt
rows after the ``<|im_start|>assistant\\n`` header, then the thinker's answer tokens.

- Prefill (once X[0] exists): the user rows (``hidden_projection`` at audio and image rows,
  ``text_projection`` elsewhere) at the rope positions the thinker gives them (``user_pos``: after
  an image they are not the rows' indices, see ``rope.py``), then the assistant part: the 3 header rows, 4 x tts_pad, tts_bos
  and X[0], added to the codec specials (nothink, think_bos, think_eos, speaker, pad, bos). It
  yields codebook-0 of frame 0.
- Decode step j: the code predictor completes frame j, which is emitted (``{"codes": [groups],
  "answer_tokens": n}``, one frame per chunk; n: the answer tokens among X[0..j], the text the
  talker had read when it drew frame j. The talker reads one token per frame, ahead of the speech
  that voices it, and the model states no finer alignment: n is what a barge-in after this frame
  keeps, an upper bound of what was audible); the talker then consumes the frame's embedding sum
  plus the text slot j:
  ``text_projection(X[j+1])``; tts_eos when X[j+1] is the thinker's last token (its EOS, or the
  token it was capped on, which the reference never voices); tts_pad after that. Step j waits
  (``runnable``) until slot j is known, so the talker never runs ahead of its text.
- Codebook-0 decoding: repetition penalty over the codes generated so far, the top 1024 ids except
  codec EOS suppressed, greedy or sampled per the stage options. It stops at codec EOS or at its
  cap; a capped talker drops the frame whose code was drawn last, as the reference does, by never
  drawing it. The cap (``output_cap``) is tied to the length of the text voiced.

Function calls are not voiced. A request whose tool_choice forces a call (``tools.py``) has no
audio at all: it holds nothing and ends at once, as a text-only request does. For a request that
offers tools, the thinker says how many answer tokens are settled as words (``settled``: text that
may open a call is not, until the thinker knows) and the talker reads only those; once a call has
begun (``call_from``), the token where its text starts takes the place of the thinker's last token
(voiced as tts_eos, as EOS would be) and nothing after it is read. Words followed by a call are
thus voiced exactly as the same words followed by EOS.

Per-request state (TalkerState in ``ARSlot.state``; KV in the runner's KVPool) lives from
``new_state`` to ``release``. Requests that do not ask for audio hold nothing and end at once.

A request of a conversation (``params["conversation"]``, set by the coordinator) gives back, at its
release, the KV of the user rows it prefilled, and the conversation's next request prefills only
the user rows after the longest prefix it shares with them (``talker_rows.py``: a cache, dropped
with the conversation; a ``ConversationCache`` to the scheduler). A piece of a user turn
prefilled while it is spoken (a partial request: the thinker's final data carries the user rows
so far) prefills those rows alone, so the answer finds them there too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from pipeline.models import StageContext
from pipeline.models.qwen3_omni import loading, tools
from pipeline.models.qwen3_omni.code_predictor import predict_frame
from pipeline.models.qwen3_omni.kv_pool import KVPool, crop_to
from pipeline.models.qwen3_omni.sampling import Sampling, SamplingParams, pick_rows
from pipeline.models.qwen3_omni.talker_rows import UserRowsCache
from pipeline.proto import StagePayload
from pipeline.scheduling.base import ARSlot, ARStepResult, RequestError
from pipeline.scheduling.conversation_book import Budget, partial_until
from pipeline.scheduling.conversations import conversation_of


@dataclass
class TalkerState:
    speaker: int | None
    sampling: Sampling
    predictor_sampling: Sampling
    prompt: dict[str, torch.Tensor] | None = None
    texts: list[torch.Tensor] = field(default_factory=list)
    answer_tokens: int = 0
    prompt_texts: int = 0
    """Rows of X before the answer (prompt rows after the assistant header; usually none)."""
    total: int | None = None
    """len(X) once the thinker's last token is known."""
    settled: int | None = None
    """Rows of X known to be words (requests with tools); None: every row read."""
    tts: torch.Tensor | None = None
    """Projected tts_bos, tts_eos, tts_pad [3, hidden], from the prefill on."""
    codes0: list[int] = field(default_factory=list)
    past_hidden: torch.Tensor | None = None
    position: int = 0
    """The rope position of the next row fed."""
    delta: int = 0
    """``position`` minus the next row's index (non-zero after images), from the prefill on."""
    frames: int = 0
    partial: bool = False
    """A piece of a user turn (``prefill_until_s``): its user rows are cached, nothing voiced."""
    conversation: str | None = None
    user_rows: torch.Tensor | None = None
    """The user rows prefilled (CPU), from the prefill on: kept for the conversation's next request."""


@dataclass(frozen=True)
class TalkerOptions:
    do_sample: bool = False
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    predictor_top_k: int = 50
    predictor_top_p: float = 0.8
    frames_per_token: int = 8
    extra_frames: int = 50
    voice: str = "ethan"


DEFAULT_VOICE = "default"
"""The voice of a request that names none (or names this): the talker stage's ``voice`` option."""


def requested_voice(request_id: str, params: dict[str, Any], speakers: Mapping[str, int]) -> str | None:
    """The voice a request asks for, lower-cased, or None when it wants no audio; a voice the
    checkpoint does not have is the request's error."""
    if "audio" not in (params.get("modalities") or ["text", "audio"]):
        return None
    voice = str(params.get("voice") or DEFAULT_VOICE).lower()
    if voice != DEFAULT_VOICE and voice not in speakers:
        raise RequestError(
            request_id, f"unknown voice {voice!r} (this model has {[DEFAULT_VOICE, *sorted(speakers)]})"
        )
    return voice


def step_cap(answer_tokens: int, opts: TalkerOptions) -> int:
    """The talker's text-tied cap in steps for an answer of ``answer_tokens`` thinker tokens.

    A step is the prefill (which draws frame 0's first code) or one frame, so a cap of n steps
    allows n - 1 frames: the same count as ``generate``'s ``talker_max_new_tokens`` = n, which
    draws n codes and drops the last frame.
    """
    return opts.frames_per_token * answer_tokens + opts.extra_frames + 1


class Talker:
    """ARRunner for the ``talker`` stage."""

    def __init__(self, ctx: StageContext) -> None:
        source = loading.resolve(ctx.model_args)
        self.device = ctx.stage.device
        self.model = loading.load_talker(source, self.device)
        config = loading.load_config(source.path)
        talker_cfg = config.talker_config
        self.text_config = talker_cfg.text_config
        self.opts = TalkerOptions(**ctx.stage.options)
        self.voices: dict[str, int] = dict(talker_cfg.speaker_id or {})
        self.eos = talker_cfg.codec_eos_token_id
        vocab = self.text_config.vocab_size
        self.suppress = tuple(i for i in range(vocab - 1024, vocab) if i != self.eos)
        self.specials = [
            talker_cfg.codec_nothink_id,
            talker_cfg.codec_think_bos_id,
            talker_cfg.codec_think_eos_id,
            -1,  # the speaker, per request
            talker_cfg.codec_pad_id,
            talker_cfg.codec_bos_id,
        ]
        self.pool = KVPool()
        self.rows = UserRowsCache(Budget.from_options(ctx.stage.options))

    # -- ARRunner ----------------------------------------------------------------------------

    def new_state(self, payload: StagePayload) -> TalkerState:
        params = payload.params
        o = self.opts
        voice = requested_voice(payload.request_id, params, self.voices)
        if tools.forced_call(params) is not None:
            voice = None  # the answer is a function call: nothing to say
        speaker = None if voice is None else self.voices[o.voice if voice == DEFAULT_VOICE else voice]
        seed = params.get("seed")
        sampling = SamplingParams(
            do_sample=o.do_sample, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p,
            repetition_penalty=o.repetition_penalty, suppress=self.suppress, seed=seed,
        )
        predictor = SamplingParams(
            do_sample=o.do_sample, top_k=o.predictor_top_k, top_p=o.predictor_top_p, seed=seed
        )
        conversation = conversation_of(params)
        return TalkerState(
            speaker=speaker,
            sampling=Sampling(sampling, self.device),
            predictor_sampling=Sampling(predictor, self.device),
            partial=bool(partial_until(params)),
            conversation=None if conversation is None else conversation.id,
        )

    def feed(self, slot: ARSlot, payload: StagePayload) -> None:
        st: TalkerState = slot.state
        data = payload.data
        if st.total is not None:
            return  # the voiced text already ended (a function call began)
        if "user_embeds" in data:
            st.prompt = {
                k: data[k] for k in ("user_embeds", "user_mm", "user_pos", "assistant_embeds", "tts_embeds")
            }
            st.texts.extend(data["assistant_embeds"][3:])
            st.prompt_texts = len(st.texts)
        st.texts.append(data["token_embed"])
        st.answer_tokens += 1
        if data.get("settled") is not None:
            st.settled = st.prompt_texts + int(data["settled"])
        if data.get("call_from") is not None:
            st.answer_tokens = int(data["call_from"]) + 1
            st.total = st.prompt_texts + st.answer_tokens
        elif data.get("last"):
            st.total = len(st.texts)

    def close_input(self, slot: ARSlot, payload: StagePayload) -> None:
        st: TalkerState = slot.state
        if st.total is None:
            st.total = len(st.texts)
        if st.partial and "user_embeds" in payload.data:
            st.prompt = {k: payload.data[k] for k in ("user_embeds", "user_mm", "user_pos")}

    def runnable(self, slot: ARSlot) -> bool:
        st: TalkerState = slot.state
        if st.speaker is None or self._silent(st):
            return True
        if st.past_hidden is None:
            return st.prompt is not None and self._text_known(st, -1)
        return self._capped_next(slot) or self._text_known(st, st.frames)

    def output_cap(self, slot: ARSlot) -> int | None:
        st: TalkerState = slot.state
        if st.total is None:
            return None
        return step_cap(st.answer_tokens, self.opts)

    @torch.inference_mode()
    def step(self, slots: list[ARSlot]) -> list[ARStepResult]:
        results: dict[str, ARStepResult] = {}
        decoding = []
        for slot in slots:
            st: TalkerState = slot.state
            if st.partial:
                results[slot.request_id] = self._prefill_rows(slot)
            elif st.speaker is None or self._silent(st):
                results[slot.request_id] = ARStepResult(None, finished=True)
            elif st.past_hidden is None:
                results[slot.request_id] = self._prefill(slot)
            else:
                decoding.append(slot)
        if decoding:
            results.update(self._decode(decoding))
        return [results[s.request_id] for s in slots]

    def finish(self, slot: ARSlot, capped: bool) -> dict[str, Any] | None:
        return None

    def release(self, slot: ARSlot) -> None:
        st: TalkerState | None = slot.state
        if st is not None and st.conversation is not None and st.user_rows is not None:
            cache = self.pool.take(slot.request_id)
            if cache is not None:
                crop_to(cache, st.user_rows.shape[0])  # the user rows, without this answer's
                self.rows.put(st.conversation, st.user_rows, cache)
        self.pool.release(slot.request_id)
        slot.state = None

    # -- ConversationCache ---------------------------------------------------------------------

    def cached_conversations(self) -> dict[str, int]:
        return self.rows.sizes()

    def drop_cached(self, conversation_id: str) -> None:
        self.rows.drop(conversation_id)

    # -- text slots ----------------------------------------------------------------------------

    @staticmethod
    def _silent(st: TalkerState) -> bool:
        """The thinker's only token was its last: nothing to voice (the reference cannot either)."""
        return st.total is not None and st.total < 2

    @staticmethod
    def _text_known(st: TalkerState, j: int) -> bool:
        """Whether X[j + 1] is known: read and settled as words, or past the voiced text's end."""
        known = len(st.texts) if st.settled is None else st.settled
        return (st.total is not None and j + 1 >= st.total - 1) or j + 1 < known

    def _text_slot(self, st: TalkerState, j: int) -> torch.Tensor:
        """The text part of the talker's input at decode step j [hidden]."""
        k = j + 1
        if st.total is not None and k >= st.total - 1:
            return st.tts[1] if k == st.total - 1 else st.tts[2]
        return self._project(st.texts[k][None])[0]

    def _project(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.model.text_projection(embeds.to(self.device, self.model.dtype))

    def _cap(self, slot: ARSlot) -> int:
        extra = self.output_cap(slot)
        return slot.cap if extra is None else min(slot.cap, extra)

    def _capped_next(self, slot: ARSlot) -> bool:
        """The next frame is the last one the cap allows (so its successor is never drawn)."""
        return slot.steps + 1 >= self._cap(slot)

    # -- compute -----------------------------------------------------------------------------

    def _prefill(self, slot: ARSlot) -> ARStepResult:
        st: TalkerState = slot.state
        prompt = st.prompt
        cache, start = self._kept_rows(st)
        user_part = self._user_part(prompt, start)
        st.tts = self._project(prompt["tts_embeds"])
        tts_bos, tts_pad = st.tts[0], st.tts[2]
        head = self._project(torch.cat([prompt["assistant_embeds"][:3], st.texts[0][None]]))
        text_part = torch.cat([head[:3], tts_pad.expand(4, -1), tts_bos[None], head[3:4]])
        specials = torch.tensor(
            [st.speaker if s == -1 else s for s in self.specials], device=self.device
        )
        codec_part = torch.cat(
            [text_part.new_zeros(3, text_part.shape[1]), self.model.get_input_embeddings()(specials)]
        )
        user_pos = prompt["user_pos"][:, start:]
        top = int(prompt["user_pos"].max()) if prompt["user_pos"].numel() else -1
        assistant_pos = torch.arange(top + 1, top + 1 + text_part.shape[0]).expand(3, -1)
        out = self._forward(
            torch.cat([user_part, text_part + codec_part]), start, cache, torch.cat([user_pos, assistant_pos], 1)
        )
        st.prompt = None
        self.pool.add(slot.request_id, cache)
        st.position = top + 1 + text_part.shape[0]
        st.delta = st.position - cache.get_seq_length()
        return ARStepResult(None, finished=self._advance([slot], out.last_hidden_state)[0])

    def _prefill_rows(self, slot: ARSlot) -> ARStepResult:
        """A piece of a user turn prefilled while it is spoken (a partial request): the
        conversation's user rows so far go into its cache for the answer; nothing is voiced."""
        st: TalkerState = slot.state
        if st.conversation is not None and st.prompt is not None:
            cache, start = self._kept_rows(st)
            if start < st.prompt["user_embeds"].shape[0]:
                self._forward(self._user_part(st.prompt, start), start, cache, st.prompt["user_pos"][:, start:])
            self.pool.add(slot.request_id, cache)
            st.prompt = None
        return ARStepResult(None, finished=True)

    def _kept_rows(self, st: TalkerState) -> tuple[DynamicCache, int]:
        """The cache to prefill the request's prompt into, and the user rows it already holds; a
        request of a conversation notes its user rows (``user_rows``), kept at its release."""
        cache, start = None, 0
        if st.conversation is not None:
            rows = st.prompt["user_embeds"]
            cache, start = self.rows.take(st.conversation, rows)
            st.user_rows = rows
        return (DynamicCache(config=self.text_config) if cache is None else cache), start

    def _user_part(self, prompt: dict[str, torch.Tensor], start: int) -> torch.Tensor:
        """The talker's input rows for the prompt's user rows from ``start`` on: projected hidden
        states at audio rows, projected text embeddings elsewhere."""
        user = prompt["user_embeds"][start:].to(self.device, self.model.dtype)
        mm = prompt["user_mm"][start:].to(self.device)
        user_part = user.new_empty(user.shape[0], self.text_config.hidden_size)
        if mm.any():
            user_part[mm] = self.model.hidden_projection(user[mm])
        user_part[~mm] = self.model.text_projection(user[~mm])
        return user_part

    def _forward(self, embeds: torch.Tensor, start: int, cache: DynamicCache, rope: torch.Tensor) -> Any:
        """The talker over ``embeds`` [rows, hidden] after ``start`` cached rows, at the rope
        positions ``rope`` [3, rows]."""
        length = start + embeds.shape[0]
        index = torch.arange(start, length)
        return self.model.model(
            inputs_embeds=embeds[None],
            position_ids=torch.cat([index[None], rope]).to(self.device)[:, None],
            attention_mask=torch.ones(1, length, dtype=torch.long, device=self.device),
            cache=cache,
            use_cache=True,
        )

    def _decode(self, slots: list[ARSlot]) -> dict[str, ARStepResult]:
        states: list[TalkerState] = [s.state for s in slots]
        code0 = torch.tensor([st.codes0[-1] for st in states], device=self.device)
        past = torch.cat([st.past_hidden for st in states])
        codes, frame_embeds = predict_frame(
            self.model, past, code0, [st.predictor_sampling for st in states]
        )
        results: dict[str, ARStepResult] = {}
        going: dict[str, tuple[ARSlot, torch.Tensor]] = {}
        frames = codes.cpu()  # one device sync for the batch
        for i, slot in enumerate(slots):
            st = slot.state
            voiced = max(0, min(st.frames + 1 - st.prompt_texts, st.answer_tokens))
            data = {"codes": frames[i], "answer_tokens": voiced}
            if self._capped_next(slot):
                results[slot.request_id] = ARStepResult(data, finished=True)
                continue
            results[slot.request_id] = ARStepResult(data)
            going[slot.request_id] = (slot, frame_embeds[i] + self._text_slot(st, st.frames))
            st.frames += 1
        if going:
            rows = self.pool.arrange(list(going))
            ordered = [going[rid][0] for rid in rows]
            rope = torch.tensor([s.state.position for s in ordered], device=self.device)
            index = torch.tensor([s.state.position - s.state.delta for s in ordered], device=self.device)
            out = self.model.model(
                inputs_embeds=torch.stack([going[rid][1] for rid in rows]),
                position_ids=torch.cat([index[None], rope.expand(3, -1)])[..., None],
                attention_mask=self.pool.attention_mask(),
                cache=self.pool.batch_cache(),
                use_cache=True,
            )
            for slot in ordered:
                slot.state.position += 1
            for slot, ended in zip(ordered, self._advance(ordered, out.last_hidden_state)):
                results[slot.request_id].finished = ended
        return results

    def _advance(self, slots: list[ARSlot], hidden: torch.Tensor) -> list[bool]:
        """Draw each row's next codebook-0 code from the talker's output ``hidden`` [rows, T, H];
        True where it is codec EOS (the row's last frame has been emitted)."""
        # The head over every position, then the last row, as generate computes it (the matmul's
        # row count changes its float rounding).
        logits = self.model.codec_head(hidden)[:, -1]
        states: list[TalkerState] = [s.state for s in slots]
        codes = pick_rows(logits, [st.sampling for st in states], [st.codes0 for st in states])
        for st, code, h in zip(states, codes, hidden):
            st.codes0.append(code)
            st.past_hidden = h[None, -1:]
        return [code == self.eos for code in codes]
