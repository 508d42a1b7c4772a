"""``qwen3_omni``: Qwen3-Omni (``Qwen3OmniMoeForConditionalGeneration``) on the pipeline.

Stages (runner names; the presets ``configs/qwen3_omni*.yaml`` wire them):

    preprocessing --next--> audio_encoder --next--> mm_aggregate (fan-in) --next--> thinker
        |   \\--next--> image_encoder --next-------^   ^                            |
        \\-------------------next----------------------/       stream_to: decode (text terminal)
                                                          talker --stream_to--> code2wav (audio)

- ``preprocessing`` (simple): chat template, audio checks/resampling, log-mel features, image patches.
- ``audio_encoder`` (simple): the thinker's audio tower, clips of a batch packed together.
- ``image_encoder`` (simple): the thinker's vision tower, images of a batch packed together
  (``vision.py``), with its deepstack features.
- ``mm_aggregate`` (simple, fan-in of the three above: merge ``mm_branches``): audio and image
  embeddings in their placeholders' order, and the prompt's 3-D rope positions when it has images
  (``aggregate.py``). A branch that fails fails the request; the stage frees the others' parts.
- ``thinker`` (ar): prefill with the audio and image embeddings (deepstack added at the image rows),
  batched decode; streams each token plus what the talker needs.
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


def make_image_encoder(ctx: StageContext) -> Any:
    from pipeline.models.qwen3_omni.vision import ImageEncoder

    return ImageEncoder(ctx)


def make_mm_aggregate(ctx: StageContext) -> Any:
    from pipeline.models.qwen3_omni.aggregate import Aggregator

    return Aggregator(ctx)


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


def merge_mm_branches(parts: dict[str, StagePayload]) -> StagePayload:
    from pipeline.models.qwen3_omni.aggregate import merge_branches

    return merge_branches(parts)


SPEC = register(
    ModelSpec(
        name="qwen3_omni",
        factories={
            "preprocessing": make_preprocessing,
            "audio_encoder": make_audio_encoder,
            "image_encoder": make_image_encoder,
            "mm_aggregate": make_mm_aggregate,
            "thinker": make_thinker,
            "decode": make_decode,
            "talker": make_talker,
            "code2wav": make_code2wav,
            "transcribe": make_transcribe,
        },
        merges={"mm_branches": merge_mm_branches},
        output_sample_rate=OUTPUT_SAMPLE_RATE,
        input_modalities=("text", "audio", "image"),
    )
)
