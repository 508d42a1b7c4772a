"""Silence the paced track makes (duplex/media/paced_track.py) is built without numpy and marked,
so OpusPacketTrack skips reading it: the frames must still be zeros on the paced schedule, and the
packets the same as for queued digital silence."""

from __future__ import annotations

import numpy as np
import pytest

from duplex.media.paced_track import (
    FRAME_SAMPLES,
    OpusPacketTrack,
    OutboundAudioTrack,
)
from duplex.media.pcm import float_to_pcm16
from harness.speech import speech
from tests.duplex.test_media_cpu_paths import StepClock


@pytest.mark.parametrize("channels", [1, 2])
async def test_made_silence_is_zeros_on_the_schedule_and_marked(channels: int) -> None:
    track = OutboundAudioTrack(clock=StepClock(), channels=channels)
    silent = await track.recv()
    assert track.made_silence
    track.enqueue("a", np.full(FRAME_SAMPLES, 1000, np.int16))
    track.enqueue("b", np.zeros(FRAME_SAMPLES, np.int16))
    loud, quiet = await track.recv(), await track.recv()
    assert not track.made_silence  # queued zeros are the agent's audio, not made silence
    made_again = await track.recv()
    assert track.made_silence
    for frame, level in ((silent, 0), (loud, 1000), (quiet, 0), (made_again, 0)):
        assert (frame.samples, len(frame.layout.channels), frame.format.name) == (
            FRAME_SAMPLES, channels, "s16")
        assert frame.sample_rate == 48000
        assert np.array_equal(frame.to_ndarray(), np.full((1, FRAME_SAMPLES * channels), level))
    assert [f.pts for f in (silent, loud, quiet, made_again)] == [0, 960, 1920, 2880]
    track.stop()


async def test_packets_for_made_silence_equal_those_for_queued_zeros() -> None:
    voice = float_to_pcm16(speech("Seven fifteen.", 48000, 0.0, 0.0))
    speaking = -(-len(voice) // FRAME_SAMPLES)
    made, queued = (OpusPacketTrack(OutboundAudioTrack(clock=StepClock())) for _ in range(2))
    for track in (made, queued):
        track.source.enqueue("a", voice)
    # 1.5 s of silence after the speech: made by one track, queued as zeros on the other.
    queued.source.enqueue("b", np.zeros(75 * FRAME_SAMPLES, np.int16))
    sent = {}
    for name, track in (("made", made), ("queued", queued)):
        packets = [await track.recv() for _ in range(speaking + 2 + 3)]  # then 3 DTX packets
        sent[name] = [(p.pts, bytes(p)) for p in packets]
        track.stop()
    assert sent["made"] == sent["queued"]
    assert [len(data) for _, data in sent["made"][-3:]] == [1, 1, 1]  # DTX: the TOC byte alone
