"""Preprocessing stage: chat template, audio checks and resampling, Whisper log-mel features.

Request inputs follow the pipeline's one shape (``pipeline.proto.OmniRequest``): ``{"messages":
[{"role": "system" | "user" | "assistant", "text": str | None, "audio": float32 mono samples |
None, "sample_rate": int | None, "images": [uint8 RGB arrays [height, width, 3]] | None,
"image_times": [seconds, one per image] | None}, ...]}``, oldest first; the answer follows the last
message, a user turn or an assistant message with text or audio. A message renders its audio
first, then its images, then its text; a message whose images come with ``image_times`` (the
frames of a camera, seen at those times) renders them as one video instead. Images are cut into
the vision tower's patches by the checkpoint's image processor (transformers' PIL/numpy one), which
scales each to its pixel bounds; a request holds at most the stage's ``max_images`` (default 16) of
at most ``max_image_pixels`` (default 4096 x 4096) each.

A video (a caller's camera during a turn) is read as Qwen3-Omni reads video (``video.py``): its
frames pair up into the tower's temporal patches (an odd count repeats its last frame, as
transformers' video processor pads), ``<|video_pad|>`` per vision token, and each pair's rope time
from the frames' own times (``second_per_grid``); its frames must be of one size. A request holds
at most ``max_video_frames`` (default 64) frames, of at most ``max_image_pixels`` each.
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

A turn prefilled while the user speaks (``conversation_book.py``): a partial request
(``params["prefill_until_s"] = S``) renders its last message, a user turn of audio alone, only up
to the audio pads of its first S seconds (no end of turn, no generation prompt); a request whose
conversation state ends inside its first message (``covered_s`` = C) renders that message from the
pads after its first C seconds on. Such an open turn's log-mel is computed over the turn's audio so
far (the frames up to S read 25 ms past it: ``LOOKAHEAD``) and cut at whole seconds, which the
audio tower's 1 s convolution chunks never straddle, so a piece's frames and token counts are those
of the whole turn. What differs from encoding the turn at once: each piece is its own clip to the
tower, whose attention spans blocks of ``n_window_infer`` frames (8 s) of one clip (pieces that are
whole blocks encode exactly); and Whisper's log-mel floor (the clip's maximum - 8) is taken over
the audio heard so far.

Output data: ``input_ids`` (1-D long tensor, one ``<|audio_pad|>`` per audio frame of the encoder,
one ``<|image_pad|>`` per vision token of each image, one ``<|video_pad|>`` per vision token of
each video), with audio ``input_features`` / ``feature_attention_mask`` (one row per clip), with
images ``pixel_values`` / ``image_grid_thw`` (the patches of every image, and each image's grid),
with videos ``pixel_values_videos`` / ``video_grid_thw`` / ``video_second_per_grid`` (float, one per
video), and when asked and
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
from pipeline.models.qwen3_omni import loading, tools, video
from pipeline.models.qwen3_omni.talker import requested_voice
from pipeline.scheduling.base import BatchItem, RequestError
from pipeline.scheduling.conversation_book import partial_until
from pipeline.scheduling.conversations import conversation_of

MIN_RATE, MAX_RATE = 8000, 192000
LOOKAHEAD = 400
"""Samples (16 kHz) read past a piece's end: its last STFT frame's window reaches 40 past it."""
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
        self.image_token_id = config.thinker_config.image_token_id
        self.video_token_id = config.thinker_config.video_token_id
        self.position_id_per_seconds = config.thinker_config.position_id_per_seconds
        self.images = loading.load_image_processor(source.path)
        self.max_images = int(ctx.stage.options.get("max_images", 16))
        self.max_image_pixels = int(ctx.stage.options.get("max_image_pixels", 4096 * 4096))
        self.max_video_frames = int(ctx.stage.options.get("max_video_frames", 64))
        self.n_window = config.thinker_config.audio_config.n_window
        self.speakers = dict(config.talker_config.speaker_id or {})
        self.max_audio_s = float(ctx.stage.options.get("max_audio_seconds", 120.0))
        if (self.features.sampling_rate // self.features.hop_length) % (2 * self.n_window):
            raise ValueError("the audio tower's convolution chunks do not fit in whole seconds")

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        return [self._one(item.payload.request_id, item.payload.data, item.payload.params) for item in batch]

    # -- one request -------------------------------------------------------------------------

    def _one(self, rid: str, inputs: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        self._check_params(rid, params)
        clips: list[np.ndarray] = []
        images: list[np.ndarray] = []
        videos: list[video.Clip] = []
        conversation = conversation_of(params)
        try:
            plain = tools.render(inputs.get("messages") or [], params,
                                 resumed=conversation is not None and conversation.resume)
            opening = tools.call_opening(params)
        except tools.ToolsError as err:
            raise RequestError(rid, str(err)) from None
        messages = [self._message(rid, m, clips, images, videos) for m in plain]
        # The template's generation prompt opens a new assistant turn after whatever came last: a
        # user turn, or an assistant message (a Realtime client asking for another answer).
        if not messages or messages[-1]["role"] == "system" or not messages[-1]["content"]:
            raise RequestError(rid, "the last message must be a user turn (or an assistant message) "
                               "with audio or text")
        covered = conversation.covered_s if conversation is not None and conversation.resume else 0
        until = partial_until(params)
        spans = self._open_spans(rid, plain, clips, covered, until)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=not until, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        if opening is not None:
            ids = list(ids) + self.tokenizer.encode(opening, add_special_tokens=False)
        markers = [i for i, t in enumerate(ids) if t == self.audio_token_id]
        if until:  # the turn goes on: nothing after its audio so far
            ids = ids[: markers[-1] + 1]
        if covered:  # the state holds the turn's header and its first seconds
            ids = ids[markers[0]:]
        out: dict[str, Any] = {}
        if clips:
            features, mask = self._features(clips, spans)
            ids = self._expand(rid, ids, self.audio_token_id, audio_token_counts(mask.sum(-1), self.n_window))
            out["input_features"] = features
            out["feature_attention_mask"] = mask
        if images:
            pixels, grids = self._patches(rid, images)
            merge = self.images.merge_size**2
            ids = self._expand(rid, ids, self.image_token_id, [int(g.prod()) // merge for g in grids])
            out["pixel_values"], out["image_grid_thw"] = pixels, grids
        if videos:
            try:
                patched = video.patches(self.images, videos, self.position_id_per_seconds)
            except ValueError as err:  # e.g. an aspect ratio the processor refuses
                raise RequestError(rid, f"video: {err}") from None
            merge = self.images.merge_size**2
            ids = self._expand(rid, ids, self.video_token_id,
                               [int(g.prod()) // merge for g in patched["video_grid_thw"]])
            out.update(patched)
        out["input_ids"] = torch.tensor(ids, dtype=torch.long)
        last = inputs["messages"][-1]
        if params.get("transcribe") and last.get("role") == "user" and last.get("audio") is not None \
                and not last.get("text"):
            out["transcribe_audio"] = clips[-1]
        return out

    def _open_spans(self, rid: str, messages: list[Any], clips: list[np.ndarray], covered: int,
                    until: int) -> dict[int, tuple[int, int | None]]:
        """The open turn's clips: index -> (first sample, end sample or None: to its end)."""
        spans: dict[int, tuple[int, int | None]] = {}
        rate = self.features.sampling_rate
        if until:
            last = messages[-1]
            if last.get("role") != "user" or last.get("audio") is None or last.get("text"):
                raise RequestError(rid, "a partial turn's last message must be a user turn of audio alone")
            if len(clips[-1]) < until * rate + LOOKAHEAD:
                raise RequestError(rid, f"a partial turn to {until} s needs {LOOKAHEAD} samples of audio "
                                   "past it")
            spans[len(clips) - 1] = (0, until * rate)
        if covered:
            first = messages[0]
            if first.get("role") != "user" or first.get("audio") is None or len(clips[0]) < covered * rate:
                raise RequestError(rid, "the open turn's audio is shorter than what the kept state holds")
            spans[0] = (covered * rate, spans.get(0, (0, None))[1])
        return spans

    def _features(self, clips: list[np.ndarray], spans: dict[int, tuple[int, int | None]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel rows of every clip (padded, with their mask); an open turn's clip is computed
        alone over its audio so far and cut to its span at whole frames."""
        def extract(batch: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
            feats = self.features(batch, sampling_rate=self.features.sampling_rate, padding=True,
                                  truncation=False, return_attention_mask=True, return_tensors="pt")
            return feats["input_features"], feats["attention_mask"]

        if not spans:
            return extract(clips)
        plain = [i for i in range(len(clips)) if i not in spans]
        rows: dict[int, torch.Tensor] = {}
        if plain:
            features, mask = extract([clips[i] for i in plain])
            rows = {i: features[k][:, mask[k].bool()] for k, i in enumerate(plain)}
        hop = self.features.hop_length
        for i, (start, end) in spans.items():
            clip = clips[i] if end is None else clips[i][: end + LOOKAHEAD]
            whole = extract([clip])[0][0]
            rows[i] = whole[:, start // hop: None if end is None else end // hop]
        longest = max(r.shape[1] for r in rows.values())
        features = torch.zeros(len(clips), rows[0].shape[0], longest)
        mask = torch.zeros(len(clips), longest, dtype=torch.long)
        for i, row in rows.items():
            features[i, :, : row.shape[1]], mask[i, : row.shape[1]] = row, 1
        return features, mask

    def _check_params(self, rid: str, params: dict[str, Any]) -> None:
        modalities = params.get("modalities") or ["text", "audio"]
        unknown = [m for m in modalities if m not in MODALITIES]
        if unknown:
            raise RequestError(rid, f"modalities {unknown} are not supported (use {list(MODALITIES)})")
        requested_voice(rid, params, self.speakers)

    def _message(self, rid: str, message: Any, clips: list[np.ndarray], images: list[np.ndarray],
                 videos: list[video.Clip]) -> dict[str, Any]:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(rid, f"messages: each message needs a role in {list(ROLES)}")
        parts: list[dict[str, str]] = []
        if message.get("audio") is not None:
            clips.append(self._audio(rid, message["audio"], message.get("sample_rate")))
            parts.append({"type": "audio", "audio": "<audio>"})
        if message.get("image_times") is not None:
            videos.append(self._video(rid, message.get("images"), message["image_times"],
                                      sum(len(v.frames) for v in videos)))
            parts.append({"type": "video", "video": "<video>"})
        else:
            for image in message.get("images") or []:
                images.append(self._image(rid, image, len(images)))
                parts.append({"type": "image", "image": "<image>"})
        if message.get("text"):
            parts.append({"type": "text", "text": str(message["text"])})
        for key in ("image", "video", "videos"):
            if message.get(key) is not None:
                raise RequestError(rid, f"messages: {key} input is not supported (text, audio and images, "
                                   "with image_times a video, are)")
        return {"role": message["role"], "content": parts}

    def _image(self, rid: str, image: Any, before: int) -> np.ndarray:
        if before >= self.max_images:
            raise RequestError(rid, f"a request holds at most {self.max_images} images")
        array = np.asarray(image)
        if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3 or min(array.shape[:2]) < 1:
            raise RequestError(rid, "an image must be a uint8 RGB array [height, width, 3]")
        if array.shape[0] * array.shape[1] > self.max_image_pixels:
            raise RequestError(rid, f"an image is {array.shape[1]}x{array.shape[0]} pixels; the limit is "
                               f"{self.max_image_pixels} pixels")
        return array

    def _video(self, rid: str, frames: Any, times: Any, before: int) -> video.Clip:
        try:
            clip = video.Clip.of(frames, times)
        except ValueError as err:
            raise RequestError(rid, f"video: {err}") from None
        if before + len(clip.frames) > self.max_video_frames:
            raise RequestError(rid, f"a request holds at most {self.max_video_frames} video frames")
        height, width = clip.frames[0].shape[:2]
        if height * width > self.max_image_pixels:
            raise RequestError(rid, f"a video frame is {width}x{height} pixels; the limit is "
                               f"{self.max_image_pixels} pixels")
        return clip

    def _patches(self, rid: str, images: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """The vision tower's patches of every image and each image's (t, h, w) grid."""
        try:
            out = self.images(images=images, return_tensors="pt")
        except ValueError as err:  # e.g. an aspect ratio the processor refuses
            raise RequestError(rid, f"image: {err}") from None
        return out["pixel_values"], out["image_grid_thw"]

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

    def _expand(self, rid: str, ids: list[int], token: int, counts: list[int]) -> list[int]:
        """Replace the i-th ``token`` (an audio or image pad) of the template with counts[i] pads."""
        places = [i for i, t in enumerate(ids) if t == token]
        if len(places) != len(counts):
            raise RequestError(rid, "the chat template did not place one marker per clip or image")
        out: list[int] = []
        start = 0
        for place, count in zip(places, counts):
            out += ids[start:place] + [token] * int(count)
            start = place + 1
        return out + ids[start:]
