"""Preprocessing: what the model accepts, and a clear error for what it does not.

Each unsupported input (nothing to answer, a wrong or missing sample rate, too long, not mono
float samples, images, unknown voice or modality) fails its own request with a RequestError naming
the problem, never the batch it came in; audio at other rates is resampled to 16 kHz.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from harness.speech import speech
from pipeline.models import StageContext
from pipeline.models.qwen3_omni.preprocess import Preprocessor
from pipeline.proto import StagePayload
from pipeline.scheduling.base import BatchItem, RequestError, RequestFailure, StageOutput
from pipeline.scheduling.simple import SimpleScheduler
from tests.models.cases import user
from tests.models.conftest import tiny_config

MAX_SECONDS = 3.0


@pytest.fixture(scope="module")
def pre() -> Preprocessor:
    config = tiny_config(preprocessing={"max_audio_seconds": MAX_SECONDS})
    return Preprocessor(StageContext(config.stage("preprocessing"), config.model_args))


def run(pre: Preprocessor, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
    return pre.run([BatchItem(StagePayload("r", {"messages": messages}, params), final=True)])[0]


def audio_tokens(out: dict[str, Any], pre: Preprocessor) -> int:
    return int((out["input_ids"] == pre.audio_token_id).sum())


@pytest.mark.parametrize(
    ("messages", "params", "message"),
    [
        ([], {}, "last message must be a user turn"),
        ([user()], {}, "last message must be a user turn"),
        ([{"role": "system", "text": "Be brief."}], {}, "last message must be a user turn"),
        ([{"role": "robot", "text": "hi"}], {}, "role"),
        ([user(audio=np.zeros(16000, np.float32), rate=4000)], {}, "sample_rate 4000"),
        ([user(audio=np.zeros(16000, np.float32), rate=None)], {}, "sample_rate None"),
        ([user(audio=np.zeros(16000, np.float32), rate=16000.5)], {}, "sample_rate 16000.5"),
        ([user(audio=np.zeros(int(16000 * (MAX_SECONDS + 1)), np.float32), rate=16000)], {},
         "the limit is 3 s"),
        ([user(audio=np.zeros((2, 16000), np.float32), rate=16000)], {}, "1-D float"),
        ([user(audio=np.zeros(16000, np.int16), rate=16000)], {}, "1-D float"),
        ([user(audio=np.full(16000, np.nan, np.float32), rate=16000)], {}, "NaN"),
        ([{**user(text="what is this"), "image": b"png"}], {}, "image input is not supported"),
        ([user(text="hi")], {"voice": "alloy"}, "unknown voice 'alloy'"),
        ([user(text="hi")], {"modalities": ["text", "video"]}, "modalities ['video']"),
    ],
)
def test_unsupported_inputs_are_rejected_clearly(
    pre: Preprocessor, messages: list, params: dict, message: str
) -> None:
    with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run(pre, messages, **params)


def test_a_bad_request_fails_alone_in_its_batch(pre: Preprocessor) -> None:
    scheduler = SimpleScheduler(pre, max_batch=8)
    scheduler.add(StagePayload("good", {"messages": [user(text="hi")]}, {}))
    scheduler.add(StagePayload("bad", {"messages": []}, {}))
    results = {r.request_id: r for r in scheduler.step()}
    assert isinstance(results["good"], StageOutput)
    assert isinstance(results["bad"], RequestFailure) and "user turn" in results["bad"].error


def test_other_rates_are_resampled_to_the_model_rate(pre: Preprocessor) -> None:
    at16 = run(pre, [user(audio=speech("hello there"), rate=16000)])
    at48 = run(pre, [user(audio=speech("hello there", rate=48000), rate=48000)])
    at8 = run(pre, [user(audio=speech("hello there", rate=8000), rate=8000)])
    assert audio_tokens(at16, pre) == audio_tokens(at48, pre) == audio_tokens(at8, pre) > 0
    assert at16["feature_attention_mask"].sum() == at48["feature_attention_mask"].sum()


def test_prompt_follows_the_chat_template(pre: Preprocessor) -> None:
    out = run(pre, [{"role": "system", "text": "Be brief."}, user(text="hi", audio=speech("hi"), rate=16000)])
    text = pre.tokenizer.decode(out["input_ids"])
    n = audio_tokens(out, pre)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<|audio_start|>"
        + "<|audio_pad|>" * n + "<|audio_end|>hi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert out["input_features"].shape[:2] == (1, 128)


def test_an_answer_may_follow_an_assistant_message_without_any_audio(pre: Preprocessor) -> None:
    # What a Realtime client's response.create after an answer asks for: another assistant turn.
    out = run(pre, [user(text="hi"), {"role": "assistant", "text": "hello"}])
    assert pre.tokenizer.decode(out["input_ids"]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert "input_features" not in out


@pytest.mark.parametrize("voice", [None, "default", "ETHAN", "chelsie"])
def test_voices_of_the_checkpoint_and_default_are_accepted(pre: Preprocessor, voice: str | None) -> None:
    assert run(pre, [user(text="hi")], voice=voice)["input_ids"].numel() > 0
