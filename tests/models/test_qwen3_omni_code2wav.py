"""Streamed code2wav equals one-shot ``code2wav(codes)`` at every chunk size (invariant 5).

100 frames reach past the pre-transformer's 72-frame sliding window, so the carried KV cache, the
causal convolution histories and the transposed convolutions' last input frame all matter. The
first chunk of n frames yields n * 1920 - 555 samples and every later one n * 1920: nothing lost
or doubled at chunk boundaries. The tiny checkpoint speaks at speech level (not RMS 1e-7 silence),
so a relative error is a real check.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.models import StageContext
from pipeline.models.qwen3_omni.code2wav import Code2Wav
from pipeline.proto import StagePayload
from tests.models.cases import rel_l2
from tests.models.conftest import tiny_config

FRAMES = 100
UPSAMPLE = 1920
LOST = 555


@pytest.fixture(scope="module")
def runner() -> Code2Wav:
    config = tiny_config()
    return Code2Wav(StageContext(config.stage("code2wav"), config.model_args))


@pytest.fixture(scope="module")
def codes(runner: Code2Wav) -> torch.Tensor:
    config = runner.streaming.model.config
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, config.codebook_size, (config.num_quantizers, FRAMES), generator=generator)


@pytest.fixture(scope="module")
def one_shot(runner: Code2Wav, codes: torch.Tensor) -> np.ndarray:
    with torch.inference_mode():
        return runner.streaming.model(codes[None])[0, 0].numpy()


def test_one_shot_is_speech_level(one_shot: np.ndarray) -> None:
    assert one_shot.shape == (FRAMES * UPSAMPLE - LOST,)
    assert 0.1 <= float(np.sqrt(np.mean(one_shot**2))) <= 0.3


@pytest.mark.parametrize("chunk", [1, 2, 5, 10])
def test_streamed_equals_one_shot(runner: Code2Wav, codes: torch.Tensor, one_shot: np.ndarray,
                                  chunk: int) -> None:
    state = runner.new_state(StagePayload("r", {}, {}))
    frames = [{"codes": codes[:, i]} for i in range(FRAMES)]
    pieces = []
    for start in range(0, FRAMES, chunk):
        batch = frames[start:start + chunk]
        out = runner.decode(state, batch, final=start + chunk >= FRAMES)
        assert out["sample_rate"] == 24000
        pieces.append(out["audio"])
    runner.release(state)
    assert [len(p) for p in pieces[:2]] == [chunk * UPSAMPLE - LOST, chunk * UPSAMPLE]
    streamed = np.concatenate(pieces)
    assert streamed.shape == one_shot.shape
    assert rel_l2(streamed, one_shot) <= 1e-4


def test_final_without_pending_frames_adds_nothing(runner: Code2Wav, codes: torch.Tensor) -> None:
    state = runner.new_state(StagePayload("r", {}, {}))
    first = runner.decode(state, [{"codes": codes[:, 0]}], final=False)["audio"]
    last = runner.decode(state, [], final=True)["audio"]
    assert len(first) == UPSAMPLE - LOST and len(last) == 0
    runner.release(state)
