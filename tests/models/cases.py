"""Requests and reference answers shared by the Qwen3-Omni model tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from transformers import Qwen3OmniMoeForConditionalGeneration

from harness.speech import speech
from pipeline.config import PipelineConfig
from pipeline.models.qwen3_omni.reference import ReferenceOutput, reference_generate
from pipeline.models.qwen3_omni.talker import TalkerOptions, step_cap
from pipeline.proto import OmniRequest, StagePayload
from pipeline.scheduling.base import BatchItem


def user(text: str | None = None, audio: np.ndarray | None = None, rate: int | None = None) -> dict:
    return {"role": "user", "text": text, "audio": audio, "sample_rate": rate}


REQUEST_IDS = ("audio16k", "audio48k", "text", "history")


def four_requests(prefix: str = "") -> list[OmniRequest]:
    """Four different requests: audio at 16 and 48 kHz, text only, history with a system prompt."""
    return [
        OmniRequest(f"{prefix}audio16k", {"messages": [
            user(audio=speech("what is the weather like today"), rate=16000),
        ]}),
        OmniRequest(f"{prefix}audio48k", {"messages": [
            {"role": "system", "text": "You are a helpful voice assistant."},
            user(audio=speech("tell me a short story", rate=48000), rate=48000),
        ]}),
        OmniRequest(f"{prefix}text", {"messages": [user(text="Hello there, who are you?")]}),
        OmniRequest(f"{prefix}history", {"messages": [
            user(text="My name is Ada."),
            {"role": "assistant", "text": "Nice to meet you, Ada."},
            user(audio=speech("and what is my name"), rate=16000, text="Answer briefly."),
        ]}),
    ]


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def talker_cap(config: PipelineConfig) -> Callable[[int], int]:
    """The preset's talker cap (in ``generate``'s units) for an answer of n thinker tokens."""
    talker = config.stage("talker")
    opts = TalkerOptions(**talker.options)
    return lambda answer: min(talker.max_new_tokens, step_cap(answer, opts))


def reference_for(
    model: Qwen3OmniMoeForConditionalGeneration,
    preprocessor: Any,
    request: OmniRequest,
    config: PipelineConfig,
) -> ReferenceOutput:
    """``generate`` of one request alone, on what the preprocessing stage made of it."""
    item = BatchItem(StagePayload(request.request_id, request.inputs, request.params), final=True)
    return reference_generate(
        model,
        preprocessor.run([item])[0],
        thinker_cap=config.stage("thinker").max_new_tokens,
        talker_cap=talker_cap(config),
        voice=request.params.get("voice", "ethan"),
    )
