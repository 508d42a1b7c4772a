"""WebRTC media faster than real time (duplex/transports/webrtc/inbound.py with
duplex/media/inbound_budget.py): each encoded frame is measured from its bytes, and what a call's
budget does not hold is dropped before it is decoded and counted; frames within it all decode."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from aiortc.codecs import get_capabilities
from prometheus_client import REGISTRY

from duplex.media.inbound_budget import BURST_S, RealTimeBudget
from duplex.transports.webrtc.inbound import LoopDecoder, frame_seconds
from tests.media.test_inbound_decoding import OPUS, opus_frames

PCMU = next(c for c in get_capabilities("audio").codecs if c.mimeType == "audio/PCMU")
log = logging.getLogger(__name__)


def dropped_s() -> float:
    value = REGISTRY.get_sample_value("duplex_inbound_audio_dropped_seconds_total", {"transport": "webrtc"})
    assert value is not None
    return value


def tone(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * 48000)) / 48000
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


@pytest.mark.parametrize(("toc", "seconds"), [
    (bytes([0x78]), 0.02),  # CELT fullband 20 ms, one frame (what browsers send)
    (bytes([0x79]), 0.04),  # the same, two frames
    (bytes([0x1B, 0x03]), 0.18),  # SILK 60 ms, three frames (code 3)
    (bytes([0x80]), 0.0025),  # CELT 2.5 ms
    (bytes([0x7B, 0x00]), 0.02),  # code 3 with no frames: malformed, charged a frame
])
def test_opus_packets_are_measured_from_their_toc(toc: bytes, seconds: float) -> None:
    assert frame_seconds(OPUS, toc + bytes(40)) == pytest.approx(seconds)


def test_g711_is_measured_by_its_length() -> None:
    assert frame_seconds(PCMU, bytes(160)) == pytest.approx(0.02)


async def test_frames_beyond_the_budget_are_dropped_before_decoding() -> None:
    encoded = opus_frames(tone(10.0))  # ten seconds at once: far faster than real time
    assert sum(frame_seconds(OPUS, f.data) for f in encoded) == pytest.approx(10.0)
    frames: asyncio.Queue = asyncio.Queue()
    decoder = LoopDecoder(frames, RealTimeBudget("webrtc", log))
    before = dropped_s()
    for frame in encoded:
        decoder.put((OPUS, frame))
    decoded = frames.qsize() * 0.02
    # The burst, and what refilled while the frames were decoded; the rest is counted, not decoded.
    assert BURST_S <= decoded < 10.0 / 2
    assert decoded + (dropped_s() - before) == pytest.approx(10.0)


async def test_frames_within_the_budget_all_decode() -> None:
    frames: asyncio.Queue = asyncio.Queue()
    decoder = LoopDecoder(frames, RealTimeBudget("webrtc", log))
    before = dropped_s()
    encoded = opus_frames(tone(BURST_S / 2))
    for frame in encoded:
        decoder.put((OPUS, frame))
    assert frames.qsize() == len(encoded) and dropped_s() == before
