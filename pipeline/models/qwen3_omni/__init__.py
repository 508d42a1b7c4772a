"""``qwen3_omni``: Qwen3-Omni (``Qwen3OmniMoeForConditionalGeneration``) on the pipeline.

Stages (runner names; the presets ``configs/qwen3_omni*.yaml`` wire them):

    preprocessing --next--> audio_encoder --next--> thinker (fan-in: merge "thinker_inputs")
          \\______________________next______________/     |
                                                 stream_to: decode (text terminal)
                                                            talker --stream_to--> code2wav (audio)

- ``preprocessing`` (simple): chat template, audio checks/resampling, log-mel features.
- ``audio_encoder`` (simple): the thinker's audio tower, clips of a batch packed together.
- ``thinker`` (ar): prefill with audio embeddings, batched decode; streams each token plus what the
  talker needs.
- ``decode`` (simple, terminal): stateless incremental detokenization -> ``{"text": delta,
  "text_tokens": n}`` (n: the answer tokens the delta covers).
- ``talker`` (ar): codec frames (code predictor per frame) from the thinker's stream, exactly as
  ``generate`` builds them; frame cap tied to the text length.
- ``code2wav`` (vocoder, terminal): exact streaming with carried state -> ``{"audio", "sample_rate",
  "answer_tokens"}`` (the answer tokens voiced so far, as the talker read them).
- ``transcribe`` (simple, terminal, beside the rest, fed by preprocessing): the user's turn as
  text, for requests that ask (``params["transcribe"]``) -> ``{"input_transcript"}`` (Whisper
  tiny.en from the offline model set).

The factories import their runner modules when called: importing this package (which the registry
does to discover models) stays cheap, and only stage processes pay for transformers' model code.
"""

from __future__ import annotations

from typing import Any

from pipeline.models import ModelSpec, StageContext, register
from pipeline.proto import StagePayload

OUTPUT_SAMPLE_RATE = 24000


def make_preprocessing(ctx: StageContext) -> Any:
    from pipeline.models.qwen3_omni.preprocess import Preprocessor

    return Preprocessor(ctx)


def make_audio_encoder(ctx: StageContext) -> Any:
    from pipeline.models.qwen3_omni.audio_encoder import AudioEncoder

    return AudioEncoder(ctx)


def make_thinker(ctx: StageContext) -> Any:
    from pipeline.models.qwen3_omni.thinker import Thinker

    return Thinker(ctx)


def make_decode(ctx: StageContext) -> Any:
    from pipeline.models.qwen3_omni.detokenize import Detokenizer

    return Detokenizer(ctx)


def make_talker(ctx: StageContext) -> Any:
    from pipeline.models.qwen3_omni.talker import Talker

    return Talker(ctx)


def make_code2wav(ctx: StageContext) -> Any:
    from pipeline.models.qwen3_omni.code2wav import Code2Wav

    return Code2Wav(ctx)


def make_transcribe(ctx: StageContext) -> Any:
    # The offline model set's recogniser (Whisper tiny.en): Qwen3-Omni hears the user but does
    # not write down what it heard.
    from pipeline.models.offline.asr import TurnTranscriber

    return TurnTranscriber(ctx)


def merge_thinker_inputs(parts: dict[str, StagePayload]) -> StagePayload:
    """Fan-in for the thinker: the prompt ids from preprocessing, the audio embeddings from the
    audio encoder (empty when the request has no audio)."""
    prompt, audio = parts["preprocessing"], parts["audio_encoder"]
    return StagePayload(
        prompt.request_id,
        {"input_ids": prompt.data["input_ids"], "audio_embeds": audio.data["audio_embeds"]},
        prompt.params,
    )


SPEC = register(
    ModelSpec(
        name="qwen3_omni",
        factories={
            "preprocessing": make_preprocessing,
            "audio_encoder": make_audio_encoder,
            "thinker": make_thinker,
            "decode": make_decode,
            "talker": make_talker,
            "code2wav": make_code2wav,
            "transcribe": make_transcribe,
        },
        merges={"thinker_inputs": merge_thinker_inputs},
        output_sample_rate=OUTPUT_SAMPLE_RATE,
    )
)
