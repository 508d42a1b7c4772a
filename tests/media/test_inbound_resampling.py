"""FrameResampler (duplex/media/resample.py) drives the filter graph av.AudioResampler builds,
pulling once per frame: the samples must be exactly those of av.AudioResampler, pulled until the
sink is empty, whatever the frames' sizes and formats."""

from __future__ import annotations

import av
import numpy as np
import pytest

from duplex.media.resample import FrameResampler


def frames(rate: int, layout: str, sizes: list[int], seed: int = 0) -> list[av.AudioFrame]:
    rng, channels, out = np.random.default_rng(seed), len(av.AudioLayout(layout).channels), []
    for size in sizes:
        pcm = (rng.standard_normal(size * channels) * 4000).astype(np.int16).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout=layout)
        frame.sample_rate = rate
        out.append(frame)
    return out


def reference(source: list[av.AudioFrame], gain: float) -> list[np.ndarray]:
    """av.AudioResampler's output for each frame, every frame it has pulled."""
    resampler, out = av.AudioResampler(format="flt", layout="mono", rate=16000), []
    for frame in source:
        pulled = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
        out.append(np.concatenate(pulled or [np.zeros(0, np.float32)]) * np.float32(gain))
    return out


@pytest.mark.parametrize(("rate", "layout", "gain"), [
    (48000, "stereo", 2 ** -0.5), (48000, "mono", 1.0), (16000, "mono", 1.0), (8000, "mono", 1.0)])
def test_frame_resampler_equals_av_audio_resampler(rate: int, layout: str, gain: float) -> None:
    # A tiny first frame (the filter's delay swallows it below 16 kHz), then 20, 10, 60 and
    # 2.5 ms frames.
    step = rate // 50
    sizes = [8] + [step, step // 2, 3 * step, rate // 400] * 20
    source = frames(rate, layout, sizes)
    resampler = FrameResampler(16000)
    got = [resampler.push(f) for f in frames(rate, layout, sizes)]
    assert all(chunk.dtype == np.float32 and chunk.ndim == 1 for chunk in got)
    # Each frame's output is out as soon as the frame is in, as with pulling until empty.
    expected = reference(source, gain)
    assert [len(chunk) for chunk in got] == [len(chunk) for chunk in expected]
    assert np.array_equal(np.concatenate(got), np.concatenate(expected))
    assert (len(got[0]) == 0) == (rate != 16000)
    assert sum(map(len, got[1:])) > 0.99 * sum(sizes[1:]) * 16000 / rate


def test_a_change_of_format_starts_a_new_graph() -> None:
    resampler = FrameResampler(16000)
    stereo, mono = frames(48000, "stereo", [960] * 5), frames(8000, "mono", [160] * 5, seed=1)
    got = np.concatenate([resampler.push(f) for f in stereo + mono])
    expected = np.concatenate(reference(stereo, 2 ** -0.5) + reference(mono, 1.0))
    assert np.array_equal(got, expected)
