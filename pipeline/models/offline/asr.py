"""The ``asr`` stage: speech recognition with faster-whisper, the entry of the offline model set.

It validates the request's messages and turns every user message that has audio and neither text
nor a ``transcript`` into text (normally only the last one: the session keeps transcripts in its
history); the clips of every request in a batch are recognised together (``transcribe_all``).
It passes on text only, so nothing large travels further: ``{"messages": [{"role",
"text"}], "input_transcript"}``, where ``input_transcript`` is the recognised text of the last
message, left out when that message came as text. It goes to the ``lm`` stage and, at the same
moment, to the ``judge`` stage (``finished_text.py``), which reports the transcript to the session
(with its judgement of the words, where the request asked), whatever the ``lm`` stage is busy
with. Stateless: nothing is kept between items (``simple`` scheduler).

:class:`TurnTranscriber` is the same recogniser as a stage beside a model that hears audio but
does not write down what it heard (Qwen3-Omni's ``transcribe`` stage): it transcribes the clip
its feeder hands it (``transcribe_audio``, 16 kHz) and answers ``{"input_transcript": text}``,
judged too where the stage's ``finished_text`` option names a language model and the request
asks (``finished_text.judged``).
"""

from __future__ import annotations

import logging
import re
import zlib
from math import gcd
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.models import StageContext
from pipeline.models.offline.finished_text import finished_text_judge, judged
from pipeline.models.offline.sources import asr_model_dir
from pipeline.scheduling.base import BatchItem, RequestError

log = logging.getLogger(__name__)

WHISPER_RATE = 16000
FRAMES_PER_SECOND = 100  # Whisper's log-mel hop is 10 ms
SHORT_WINDOW_MAX_S = 25.0
# Whisper was trained on 30 s windows of audio padded with silence. A shorter window, padded with
# silence as audio (not with zeros as features, which Whisper reads as something else), and at least
# twice the clip: shorter ones looped ("What is the capital of France? What is the capital of") on
# up to half the placements of a natural voice's question; from 8 s up none of 120 did.
SHORT_WINDOW_MIN_S = 10
WHISPER_WINDOW_S = 30
MAX_TRANSCRIPT_TOKENS = 224  # Whisper's own cap on a window's text
# Nobody says more than ~5 tokens a second; a cap tied to the clip's length ends a decoder that
# loops on its own words (seen: a 2 s question transcribed as itself sixteen times over). A text
# that compresses better than Whisper's own threshold, or that says a run of LOOP_WORDS words
# twice, is such a loop: faster-whisper's full path, with its temperature fallback, decodes the
# clip again. The cap counts text tokens and is applied to each clip's tokens after decoding, so
# that clips with different caps share one batched decode. (CTranslate2's Whisper ``generate``
# returns at most ``max_length // 2`` tokens, measured with tiny.en: 10 -> 5, 40 -> 20; these
# values keep the cap this stage had when it passed 8 per second + 8 as ``max_length``.)
TOKENS_PER_SECOND_CAP = 4
TOKENS_EXTRA = 4
MAX_COMPRESSION_RATIO = 2.4
LOOP_WORDS = 4
ROLES = ("system", "user", "assistant")
Clip = tuple[np.ndarray, int]  # samples and their rate


def to_whisper_rate(audio: np.ndarray, rate: int) -> np.ndarray:
    """Mono float32 samples at 16 kHz (polyphase resampling: no aliasing into the speech band)."""
    samples = np.asarray(audio, dtype=np.float32).reshape(-1)
    if rate == WHISPER_RATE:
        return samples
    from scipy.signal import resample_poly

    common = gcd(WHISPER_RATE, rate)
    return resample_poly(samples, WHISPER_RATE // common, rate // common).astype(np.float32)


class Transcriber:
    """faster-whisper on a CTranslate2 Whisper model; also what tests and benchmarks use to check
    what the agent said. Holds only the model.

    faster-whisper pads every clip to Whisper's 30 s window, so the encoder costs the same for a
    3 s question as for 30 s of speech (~0.7 s of the first-audio latency on 2 busy cores).
    CTranslate2's Whisper encoder also takes a shorter window: a clip of up to
    ``SHORT_WINDOW_MAX_S`` is encoded in a window of twice its length (at least
    ``SHORT_WINDOW_MIN_S``, at most 30 s, in whole seconds), about 5x faster on a 3 s question with
    the same words; longer audio goes through faster-whisper's own 30 s segmentation.
    """

    def __init__(self, model_dir: Path, threads: int = 1) -> None:
        from faster_whisper import WhisperModel
        from faster_whisper.tokenizer import Tokenizer

        self._model = WhisperModel(
            str(model_dir), device="cpu", compute_type="int8", cpu_threads=threads
        )
        self._tokenizer = Tokenizer(
            self._model.hf_tokenizer,
            self._model.model.is_multilingual,
            task="transcribe",
            language="en",
        )
        self._prompt = self._model.get_prompt(self._tokenizer, [], without_timestamps=True)

    def transcribe(self, audio: np.ndarray, rate: int) -> str:
        (text,) = self.transcribe_all([(audio, rate)])
        return text

    def transcribe_all(self, clips: list[Clip]) -> list[str]:
        """Each ``(samples, rate)`` clip's text, the same as ``transcribe`` gives it alone: short
        clips whose windows have the same length share one batched decode."""
        samples = [to_whisper_rate(audio, rate) for audio, rate in clips]
        texts = [""] * len(samples)
        windows: dict[int, list[int]] = {}
        for index, clip in enumerate(samples):
            if 0 < clip.size <= SHORT_WINDOW_MAX_S * WHISPER_RATE:
                windows.setdefault(_window_seconds(clip), []).append(index)
            elif clip.size:
                texts[index] = self._transcribe_full(clip)
        for seconds, members in windows.items():
            heard = self._transcribe_short([samples[i] for i in members], seconds)
            for index, text in zip(members, heard, strict=True):
                texts[index] = text
        return texts

    def _transcribe_full(self, samples: np.ndarray) -> str:
        # No VAD filter: on short clips it clipped a leading word. Greedy decoding and no previous
        # text as context: the fastest settings, and exact on clear speech.
        segments, _ = self._model.transcribe(
            samples,
            language="en",
            beam_size=1,
            vad_filter=False,
            condition_on_previous_text=False,
            without_timestamps=True,
        )
        return " ".join(s.text.strip() for s in segments).strip()

    def _transcribe_short(self, clips: list[np.ndarray], seconds: int) -> list[str]:
        """Clips of one window length: each encoded alone, then decoded together (greedy).

        Encoding a batch costs at least the sum of its clips on the CPU (measured: 4 windows of
        10 s in 0.5-0.8 s against 0.07-0.15 s each alone), while the decoder's steps are small
        enough to gain from a batch (4 questions decoded in ~0.6x the time of one by one), and each
        row decodes exactly as it does alone (greedy; checked by tests/models/test_offline_batching).
        """
        import ctranslate2

        encoded = [np.asarray(self._model.model.encode(self._window(clip, seconds)))
                   for clip in clips]
        caps = [min(MAX_TRANSCRIPT_TOKENS,
                    int(clip.size / WHISPER_RATE * TOKENS_PER_SECOND_CAP) + TOKENS_EXTRA)
                for clip in clips]
        results = self._model.model.generate(
            ctranslate2.StorageView.from_array(np.ascontiguousarray(np.concatenate(encoded))),
            [self._prompt] * len(clips),
            beam_size=1,
            max_length=2 * max(caps),
        )
        texts = []
        for clip, cap, result in zip(clips, caps, results, strict=True):
            tokens = [t for t in result.sequences_ids[0][:cap] if t < self._tokenizer.eot]
            text = self._tokenizer.decode(tokens).strip()
            if _compression_ratio(text) > MAX_COMPRESSION_RATIO or _says_a_run_twice(text):
                text = self._transcribe_full(clip)
            texts.append(text)
        return texts

    def _window(self, samples: np.ndarray, seconds: int) -> Any:
        """The clip's log-mel features in a window of ``seconds``, padded with silence as audio."""
        import ctranslate2

        padded = np.zeros(seconds * WHISPER_RATE, dtype=np.float32)
        padded[: samples.size] = samples
        features = self._model.feature_extractor(padded, padding=0)
        return ctranslate2.StorageView.from_array(
            np.ascontiguousarray(features[None, :, : seconds * FRAMES_PER_SECOND])
        )


def _window_seconds(samples: np.ndarray) -> int:
    """The short window for a clip: twice its length in whole seconds, within Whisper's bounds."""
    seconds = int(np.ceil(2 * samples.size / WHISPER_RATE))
    return min(WHISPER_WINDOW_S, max(SHORT_WINDOW_MIN_S, seconds))


def _compression_ratio(text: str) -> float:
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def _says_a_run_twice(text: str) -> bool:
    """Whether some run of ``LOOP_WORDS`` words occurs twice (case and punctuation ignored)."""
    words = re.findall(r"[a-z0-9']+", text.lower())
    runs = [tuple(words[i:i + LOOP_WORDS]) for i in range(len(words) - LOOP_WORDS + 1)]
    return len(set(runs)) < len(runs)


class Recognizer:
    """The ``asr`` stage's BatchRunner: the batch's clips are recognised in one
    ``transcribe_all``, then each item's conversation is passed on as text."""

    def __init__(self, ctx: StageContext) -> None:
        self._max_audio_s = float(ctx.stage.options.get("max_audio_seconds", 120))
        self._transcriber = Transcriber(
            asr_model_dir(str(ctx.model_args.get("asr", "packaged"))), threads=ctx.stage.threads
        )

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        # A bad request raises before anything is recognised: the scheduler then reruns the
        # batch one by one and fails only that request.
        wanted = [self._clips(item.payload.request_id, item.payload.data) for item in batch]
        keys = [(b, index) for b, clips in enumerate(wanted) for index in clips]
        texts = self._transcriber.transcribe_all([wanted[b][index] for b, index in keys])
        heard: list[dict[int, str]] = [{} for _ in batch]
        for (b, index), text in zip(keys, texts, strict=True):
            heard[b][index] = text
            audio, rate = wanted[b][index]
            log.info("request %s: message %d transcribed (%.1f s): %r",
                     batch[b].payload.request_id, index, audio.size / rate, text)
        return [self._prepare(item.payload.request_id, item.payload.data["messages"], said)
                for item, said in zip(batch, heard, strict=True)]

    def _clips(self, rid: str, inputs: dict[str, Any]) -> dict[int, Clip]:
        """The request's messages checked, and the clip of each that needs recognising, by index:
        user audio without text (a turn the session already has a transcript of is not
        recognised again)."""
        messages = inputs.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(rid, "inputs.messages must be a non-empty list")
        clips: dict[int, Clip] = {}
        for index, message in enumerate(messages):
            role = message.get("role")
            if role not in ROLES:
                raise RequestError(
                    rid, f"messages[{index}].role must be one of {ROLES}, got {role!r}"
                )
            if (role == "user" and _text_of(message) is None
                    and message.get("audio") is not None):
                clips[index] = self._clip(rid, index, message)
        return clips

    def _clip(self, rid: str, index: int, message: dict[str, Any]) -> Clip:
        rate = message.get("sample_rate")
        if not isinstance(rate, int) or not 8000 <= rate <= 192000:
            raise RequestError(rid, f"messages[{index}].sample_rate {rate!r} is not supported")
        audio = np.asarray(message["audio"], dtype=np.float32)
        if audio.size > self._max_audio_s * rate:
            raise RequestError(
                rid, f"messages[{index}].audio is longer than {self._max_audio_s:.0f} s"
            )
        return audio, rate

    def _prepare(self, rid: str, messages: list[dict[str, Any]],
                 heard: dict[int, str]) -> dict[str, Any]:
        """The item's output, given the text ``heard`` in its clips (by message index)."""
        out: list[dict[str, str]] = []
        for index, message in enumerate(messages):
            text = heard.get(index, _text_of(message))
            if text is None:
                if index == len(messages) - 1:
                    raise RequestError(rid, "the last message has neither text nor audio to answer")
                continue  # e.g. an assistant turn that was audio only: nothing to show the LM
            out.append({"role": message["role"], "text": str(text)})
        # Only a turn heard as audio has a transcript to report (the judge stage reports it).
        transcript = heard.get(len(messages) - 1)
        if transcript is None:
            return {"messages": out}
        return {"messages": out, "input_transcript": transcript}


def _text_of(message: dict[str, Any]) -> Any:
    """A message's own words: its text, else the transcript the session already has."""
    return message.get("text") or message.get("transcript")


class TurnTranscriber:
    """BatchRunner of a ``transcribe`` stage beside another model (module doc): one answer per
    item, ``{}`` when the item brings no clip (the request did not ask, or its turn was text)."""

    def __init__(self, ctx: StageContext) -> None:
        self._transcriber = Transcriber(
            asr_model_dir(str(ctx.stage.options.get("asr", "packaged"))), threads=ctx.stage.threads
        )
        self._judge = finished_text_judge(ctx)

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        clips = {b: np.asarray(item.payload.data["transcribe_audio"], dtype=np.float32)
                 for b, item in enumerate(batch)
                 if item.payload.data.get("transcribe_audio") is not None}
        texts = dict(zip(clips, self._transcriber.transcribe_all(
            [(clip, WHISPER_RATE) for clip in clips.values()]), strict=True))
        return [self._one(item.payload.request_id, item.payload.params, clips[b], texts[b])
                if b in clips else {} for b, item in enumerate(batch)]

    def _one(self, rid: str, params: dict[str, Any], clip: np.ndarray, text: str) -> dict[str, Any]:
        log.info("request %s: the user's turn transcribed (%.1f s): %r", rid,
                 clip.size / WHISPER_RATE, text)
        # No context: the feeder hands the clip alone.
        return {"input_transcript": text, **judged(params, self._judge, text, None)}
