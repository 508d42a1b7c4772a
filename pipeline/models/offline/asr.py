"""The ``asr`` stage: speech recognition with faster-whisper, the entry of the offline model set.

It validates the request's messages and turns every user message that has audio and neither text
nor a ``transcript`` into text (normally only the last one: the session keeps transcripts in its
history). It passes on text only, so nothing large travels further: ``{"messages": [{"role",
"text"}], "input_transcript"}``, where ``input_transcript`` is the recognised text of the last
message, left out when that message came as text. The stage is a terminal too, so the transcript
reaches the session as soon as it is recognised, whatever the ``lm`` stage is busy with. Stateless: nothing is kept between items
(``simple`` scheduler).

:class:`TurnTranscriber` is the same recogniser as a stage beside a model that hears audio but
does not write down what it heard (Qwen3-Omni's ``transcribe`` stage): it transcribes the clip
its feeder hands it (``transcribe_audio``, 16 kHz) and answers ``{"input_transcript": text}``.

Both judge the words too where the stage's ``finished_text`` option names a language model and
the request asks (``params["end_of_turn"]``: semantic_vad's speculative answer, begun at a pause
of a turn that may go on): ``input_end_of_turn`` is then P(the turn is finished) from the words
(``finished_text.py``), for the session's turn detector.
"""

from __future__ import annotations

import logging
import re
import zlib
from math import gcd
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.models import StageContext
from pipeline.models.offline.sources import asr_model_dir
from pipeline.scheduling.base import BatchItem, RequestError

if TYPE_CHECKING:
    from pipeline.models.offline.finished_text import FinishedText

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
# clip again.
TOKENS_PER_SECOND_CAP = 8
TOKENS_EXTRA = 8
MAX_COMPRESSION_RATIO = 2.4
LOOP_WORDS = 4
ROLES = ("system", "user", "assistant")


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
        samples = to_whisper_rate(audio, rate)
        if samples.size == 0:
            return ""
        if samples.size <= SHORT_WINDOW_MAX_S * WHISPER_RATE:
            return self._transcribe_short(samples)
        return self._transcribe_full(samples)

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

    def _transcribe_short(self, samples: np.ndarray) -> str:
        import ctranslate2

        seconds = int(np.ceil(2 * samples.size / WHISPER_RATE))
        seconds = min(WHISPER_WINDOW_S, max(SHORT_WINDOW_MIN_S, seconds))
        padded = np.zeros(seconds * WHISPER_RATE, dtype=np.float32)
        padded[: samples.size] = samples
        features = self._model.feature_extractor(padded, padding=0)
        window = np.ascontiguousarray(features[None, :, : seconds * FRAMES_PER_SECOND])
        (result,) = self._model.model.generate(
            ctranslate2.StorageView.from_array(window),
            [self._prompt],
            beam_size=1,
            max_length=min(MAX_TRANSCRIPT_TOKENS,
                           int(samples.size / WHISPER_RATE * TOKENS_PER_SECOND_CAP) + TOKENS_EXTRA),
        )
        tokens = [t for t in result.sequences_ids[0] if t < self._tokenizer.eot]
        text = self._tokenizer.decode(tokens).strip()
        if _compression_ratio(text) > MAX_COMPRESSION_RATIO or _says_a_run_twice(text):
            return self._transcribe_full(samples)
        return text


def _compression_ratio(text: str) -> float:
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def _says_a_run_twice(text: str) -> bool:
    """Whether some run of ``LOOP_WORDS`` words occurs twice (case and punctuation ignored)."""
    words = re.findall(r"[a-z0-9']+", text.lower())
    runs = [tuple(words[i:i + LOOP_WORDS]) for i in range(len(words) - LOOP_WORDS + 1)]
    return len(set(runs)) < len(runs)


def finished_text_judge(ctx: StageContext) -> FinishedText | None:
    """The stage's text end-of-turn judge, where its ``finished_text`` option names a language
    model (``packaged``, a GGUF file or a Hugging Face folder: as the offline ``lm``'s)."""
    choice = ctx.stage.options.get("finished_text")
    if choice is None:
        return None
    from pipeline.models.offline.finished_text import FinishedText

    return FinishedText(str(choice))


def judged(params: dict[str, Any], judge: FinishedText | None, transcript: str,
           context: str | None) -> dict[str, float]:
    """``{"input_end_of_turn": P(finished)}`` for a request that asks (``params["end_of_turn"]``:
    a turn that may not have ended yet, a speculative answer's) where the stage has a judge."""
    if judge is None or not params.get("end_of_turn"):
        return {}
    return {"input_end_of_turn": judge.probability(transcript, context)}


class Recognizer:
    """The ``asr`` stage's BatchRunner (one transcription per message that needs one)."""

    def __init__(self, ctx: StageContext) -> None:
        self._max_audio_s = float(ctx.stage.options.get("max_audio_seconds", 120))
        self._transcriber = Transcriber(
            asr_model_dir(str(ctx.model_args.get("asr", "packaged"))), threads=ctx.stage.threads
        )
        self._judge = finished_text_judge(ctx)

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        return [self._prepare(item.payload.request_id, item.payload.data, item.payload.params)
                for item in batch]

    def _prepare(self, rid: str, inputs: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        messages = inputs.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(rid, "inputs.messages must be a non-empty list")
        out: list[dict[str, str]] = []
        transcript: str | None = None
        for index, message in enumerate(messages):
            # A turn the session already has a transcript of is not recognised again.
            role, text = message.get("role"), message.get("text") or message.get("transcript")
            if role not in ROLES:
                raise RequestError(
                    rid, f"messages[{index}].role must be one of {ROLES}, got {role!r}"
                )
            last = index == len(messages) - 1
            if text is None and role == "user" and message.get("audio") is not None:
                text = self._transcribe(rid, index, message)
                if last:
                    transcript = text
            if text is None:
                if last:
                    raise RequestError(rid, "the last message has neither text nor audio to answer")
                continue  # e.g. an assistant turn that was audio only: nothing to show the LM
            out.append({"role": role, "text": str(text)})
        # Only a turn heard as audio has a transcript to report (this stage is a terminal too).
        if transcript is None:
            return {"messages": out}
        # The user answers the assistant's last words: "Yes." ends a turn after a question.
        context = next((m["text"] for m in reversed(out[:-1]) if m["role"] == "assistant"), None)
        return {"messages": out, "input_transcript": transcript,
                **judged(params, self._judge, transcript, context)}

    def _transcribe(self, rid: str, index: int, message: dict[str, Any]) -> str:
        rate = message.get("sample_rate")
        if not isinstance(rate, int) or not 8000 <= rate <= 192000:
            raise RequestError(rid, f"messages[{index}].sample_rate {rate!r} is not supported")
        audio = np.asarray(message["audio"], dtype=np.float32)
        if audio.size > self._max_audio_s * rate:
            raise RequestError(
                rid, f"messages[{index}].audio is longer than {self._max_audio_s:.0f} s"
            )
        text = self._transcriber.transcribe(audio, rate)
        log.info(
            "request %s: message %d transcribed (%.1f s): %r", rid, index, audio.size / rate, text
        )
        return text


class TurnTranscriber:
    """BatchRunner of a ``transcribe`` stage beside another model (module doc): one answer per
    item, ``{}`` when the item brings no clip (the request did not ask, or its turn was text)."""

    def __init__(self, ctx: StageContext) -> None:
        self._transcriber = Transcriber(
            asr_model_dir(str(ctx.stage.options.get("asr", "packaged"))), threads=ctx.stage.threads
        )
        self._judge = finished_text_judge(ctx)

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        return [self._one(item.payload.request_id, item.payload.data, item.payload.params)
                for item in batch]

    def _one(self, rid: str, data: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        clip = data.get("transcribe_audio")
        if clip is None:
            return {}
        text = self._transcriber.transcribe(np.asarray(clip, dtype=np.float32), WHISPER_RATE)
        log.info("request %s: the user's turn transcribed (%.1f s): %r", rid,
                 len(clip) / WHISPER_RATE, text)
        # No context: the feeder hands the clip alone.
        return {"input_transcript": text, **judged(params, self._judge, text, None)}
