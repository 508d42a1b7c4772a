"""Preprocessing stage: chat template, audio checks and resampling, Whisper log-mel features.

Request inputs follow the pipeline's one shape (``pipeline.proto.OmniRequest``): ``{"messages":
[{"role": "system" | "user" | "assistant", "text": str | None, "audio": float32 mono samples |
None, "sample_rate": int | None}, ...]}``, oldest first; the answer follows the last message, a
user turn or an assistant message with text or audio. A message with both renders its audio first.
Audio at any rate from 8 kHz to 192 kHz is resampled to the feature extractor's 16 kHz with PyAV; audio longer
than the stage's ``max_audio_seconds`` (default 120) is refused.

Function calling adds optional fields (``text`` then holds a plain rendering for models that read
text only, which this model does not use):

- an assistant message's ``tool_calls``: ``[{"call_id", "name", "arguments"}]``, the calls it made
  after its words ``words`` (str | None); Qwen writes them as ``<tool_call>`` blocks in that turn;
- a user message's ``tool_result``: ``{"call_id", "name", "output"}``, a call's result; Qwen
  writes it as a ``<tool_response>`` block, consecutive results in one user turn.

Request params read here: ``voice`` (``default`` or a speaker of the checkpoint, checked early so
a request fails before the thinker runs), ``modalities`` (subset of ``["text", "audio"]``),
``transcribe`` (hand the last user turn's audio to the ``transcribe`` stage), ``tools`` and
``tool_choice`` (``tools.py``: the tools section of the system turn, left out when the request
resumes a kept conversation, whose state has it; a forced call's opening after the generation
prompt).

Output data: ``input_ids`` (1-D long tensor, one ``<|audio_pad|>`` per audio frame of the encoder),
with audio ``input_features`` / ``feature_attention_mask`` (one row per clip), and when asked and
the last message is a user turn heard as audio only, ``transcribe_audio`` (its 16 kHz clip). The runner is
stateless: nothing outlives ``run``.
"""

from __future__ import annotations

from typing import Any

import av
import numpy as np
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    _get_feat_extract_output_lengths,
)

from pipeline.models import StageContext
from pipeline.models.qwen3_omni import loading, tools
from pipeline.models.qwen3_omni.talker import requested_voice
from pipeline.scheduling.base import BatchItem, RequestError
from pipeline.scheduling.conversations import conversation_of

MIN_RATE, MAX_RATE = 8000, 192000
ROLES = ("system", "user", "assistant")
MODALITIES = ("text", "audio")


def audio_token_counts(feature_lens: torch.Tensor, n_window: int) -> list[int]:
    """Encoder output frames (= ``<|audio_pad|>`` tokens) per clip of ``feature_lens`` mel frames."""
    return [int(n) for n in _get_feat_extract_output_lengths(feature_lens, n_window).tolist()]


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Mono float32 ``samples`` at ``rate`` resampled to ``target`` with PyAV (libswresample)."""
    if rate == target:
        return samples
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target)
    frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    frames = resampler.resample(frame) + resampler.resample(None)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32)


class Preprocessor:
    """BatchRunner for the ``preprocessing`` stage; one independent result per item."""

    def __init__(self, ctx: StageContext) -> None:
        source = loading.resolve(ctx.model_args)
        self.tokenizer = loading.load_tokenizer(source.path)
        self.features = loading.load_feature_extractor(source.path)
        config = loading.load_config(source.path)
        self.audio_token_id = config.thinker_config.audio_token_id
        self.n_window = config.thinker_config.audio_config.n_window
        self.speakers = dict(config.talker_config.speaker_id or {})
        self.max_audio_s = float(ctx.stage.options.get("max_audio_seconds", 120.0))

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        return [self._one(item.payload.request_id, item.payload.data, item.payload.params) for item in batch]

    # -- one request -------------------------------------------------------------------------

    def _one(self, rid: str, inputs: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        self._check_params(rid, params)
        clips: list[np.ndarray] = []
        conversation = conversation_of(params)
        try:
            plain = tools.render(inputs.get("messages") or [], params,
                                 resumed=conversation is not None and conversation.resume)
            opening = tools.call_opening(params)
        except tools.ToolsError as err:
            raise RequestError(rid, str(err)) from None
        messages = [self._message(rid, m, clips) for m in plain]
        # The template's generation prompt opens a new assistant turn after whatever came last: a
        # user turn, or an assistant message (a Realtime client asking for another answer).
        if not messages or messages[-1]["role"] == "system" or not messages[-1]["content"]:
            raise RequestError(rid, "the last message must be a user turn (or an assistant message) "
                               "with audio or text")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        if opening is not None:
            ids = list(ids) + self.tokenizer.encode(opening, add_special_tokens=False)
        out: dict[str, Any] = {}
        if clips:
            feats = self.features(
                clips,
                sampling_rate=self.features.sampling_rate,
                padding=True,
                truncation=False,
                return_attention_mask=True,
                return_tensors="pt",
            )
            mask = feats["attention_mask"]
            ids = self._expand_audio(rid, ids, audio_token_counts(mask.sum(-1), self.n_window))
            out["input_features"] = feats["input_features"]
            out["feature_attention_mask"] = mask
        out["input_ids"] = torch.tensor(ids, dtype=torch.long)
        last = inputs["messages"][-1]
        if params.get("transcribe") and last.get("role") == "user" and last.get("audio") is not None \
                and not last.get("text"):
            out["transcribe_audio"] = clips[-1]
        return out

    def _check_params(self, rid: str, params: dict[str, Any]) -> None:
        modalities = params.get("modalities") or ["text", "audio"]
        unknown = [m for m in modalities if m not in MODALITIES]
        if unknown:
            raise RequestError(rid, f"modalities {unknown} are not supported (use {list(MODALITIES)})")
        requested_voice(rid, params, self.speakers)

    def _message(self, rid: str, message: Any, clips: list[np.ndarray]) -> dict[str, Any]:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(rid, f"messages: each message needs a role in {list(ROLES)}")
        parts: list[dict[str, str]] = []
        if message.get("audio") is not None:
            clips.append(self._audio(rid, message["audio"], message.get("sample_rate")))
            parts.append({"type": "audio", "audio": "<audio>"})
        if message.get("text"):
            parts.append({"type": "text", "text": str(message["text"])})
        for key in ("image", "images", "video", "videos"):
            if message.get(key) is not None:
                raise RequestError(rid, f"messages: {key} input is not supported (text and audio are)")
        return {"role": message["role"], "content": parts}

    def _audio(self, rid: str, samples: Any, rate: Any) -> np.ndarray:
        array = np.asarray(samples)
        if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.floating):
            raise RequestError(rid, "audio must be a non-empty 1-D float array (mono samples)")
        if not isinstance(rate, (int, np.integer)) or not MIN_RATE <= int(rate) <= MAX_RATE:
            raise RequestError(
                rid, f"audio sample_rate {rate!r} is not supported (an integer in {MIN_RATE}..{MAX_RATE} Hz)"
            )
        seconds = array.size / int(rate)
        if seconds > self.max_audio_s:
            raise RequestError(
                rid, f"audio is {seconds:.1f} s long; the limit is {self.max_audio_s:g} s per request"
            )
        array = array.astype(np.float32)
        if not np.isfinite(array).all():
            raise RequestError(rid, "audio contains NaN or infinite samples")
        return resample(array, int(rate), self.features.sampling_rate)

    def _expand_audio(self, rid: str, ids: list[int], counts: list[int]) -> list[int]:
        """Replace the i-th ``<|audio_pad|>`` of the template with counts[i] pads."""
        places = [i for i, t in enumerate(ids) if t == self.audio_token_id]
        if len(places) != len(counts):
            raise RequestError(rid, "the chat template did not place one audio marker per clip")
        out: list[int] = []
        start = 0
        for place, count in zip(places, counts):
            out += ids[start:place] + [self.audio_token_id] * int(count)
            start = place + 1
        return out + ids[start:]
