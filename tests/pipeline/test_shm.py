"""The shared-memory data plane: tensors and arrays round-trip exactly through ShmWriter.dumps and
loads, small ones stay inline, and segments live exactly until acknowledged (or the writer closes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.proto import StagePayload, StreamChunk
from pipeline.transport.shm import SHM_DIR, ShmWriter, leftover_segments, loads

VALUES: dict[str, Any] = {
    "float32": torch.randn(3, 257),
    "bfloat16": torch.randn(1024).to(torch.bfloat16),
    "int64": torch.arange(-600, 600, dtype=torch.int64).reshape(2, 3, 200),
    "bool": torch.rand(5000) > 0.5,
    "transposed": torch.randn(64, 48).t(),
    "scalar": torch.tensor(3.25),
    "empty": torch.empty(0, 16),
    "numpy float32": np.random.default_rng(0).standard_normal(4000).astype(np.float32),
    "numpy int16 fortran": np.asfortranarray(np.arange(6000, dtype=np.int16).reshape(60, 100)),
    "numpy empty": np.zeros((0, 3), dtype=np.float64),
    # No single raw buffer: pickled their own way (a sparse tensor's dense parts are then lifted).
    "sparse": torch.eye(300).to_sparse(),
    "numpy structured": np.array([(1, 2.5)] * 500, dtype=[("a", "i4"), ("b", "f8")]),
}
PICKLED_AS_IS = {"numpy structured"}


def own_segments() -> list[Path]:
    return [p for p in leftover_segments() if p.name.startswith(f"duplex-{os.getpid()}-")]


def assert_same(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and got.layout == want.layout
        assert torch.equal(got.to_dense(), want.to_dense())
    else:
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("threshold", [0, 1 << 20], ids=["shared memory", "inline"])
@pytest.mark.parametrize("name", VALUES)
def test_a_value_round_trips_exactly(name: str, threshold: int) -> None:
    writer = ShmWriter(threshold)
    value = VALUES[name]
    message, segments = loads(writer.dumps(StreamChunk(StagePayload("req", {"x": value}), "s", 0)))
    assert_same(message.payload.data["x"], value)
    assert bool(segments) == (threshold == 0 and name not in PICKLED_AS_IS)
    for segment in segments:
        writer.release(segment)
    assert writer.bytes_held == 0 and own_segments() == []


def test_one_segment_per_message_released_on_ack() -> None:
    writer = ShmWriter(threshold=1024)
    big = {name: VALUES[name] for name in ("float32", "bfloat16", "int64", "numpy float32")}
    small = torch.ones(4)
    body = writer.dumps({"big": big, "small": small, "text": "hi"})
    (segment,) = own_segments()  # every lifted tensor of the message shares one segment
    want_bytes = sum(v.numel() * v.element_size() if isinstance(v, torch.Tensor) else v.nbytes
                     for v in big.values())
    assert writer.bytes_held == want_bytes == segment.stat().st_size

    message, segments = loads(body)
    assert segments == {segment.name}
    for name, value in big.items():
        assert_same(message["big"][name], value)
    assert_same(message["small"], small)
    assert message["text"] == "hi"
    # The receiver's copies do not depend on the segment: unlinking it leaves them intact.
    writer.release(segment.name)
    assert not (SHM_DIR / segment.name).exists() and writer.bytes_held == 0
    assert_same(message["big"]["float32"], big["float32"])
    writer.release(segment.name)  # a duplicate ack is harmless


def test_close_frees_every_unacknowledged_segment() -> None:
    writer = ShmWriter(threshold=0)
    for i in range(5):
        writer.dumps({"i": torch.full((100,), i)})
    assert len(own_segments()) == 5 and writer.bytes_held == 5 * 100 * 8
    writer.close()
    assert own_segments() == [] and writer.bytes_held == 0
