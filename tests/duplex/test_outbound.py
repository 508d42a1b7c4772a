"""OutboundAudioTrack: framing, accounting and controls by calling recv() as aiortc's sender does,
then pacing and playout on a real aiortc loopback pair."""

from __future__ import annotations

import time

import numpy as np
import pytest
from aiortc.mediastreams import AudioStreamTrack, MediaStreamError
from prometheus_client import REGISTRY

from duplex.media.frame_queue import TrackEvent
from duplex.media.paced_track import DTX_INTERVAL_FRAMES, FRAME_SAMPLES, OutboundAudioTrack
from duplex.transports.webrtc.peer import CallPeer
from harness.peers import LOOPBACK, ClientPeer, Recorder


def ramp(n: int, start: int = 1) -> np.ndarray:
    """Distinct non-zero samples, so every sample's origin can be traced."""
    return np.arange(start, start + n, dtype=np.int16)


async def next_mono(track: OutboundAudioTrack) -> np.ndarray:
    frame = await track.recv()
    assert (frame.sample_rate, frame.samples, frame.format.name) == (48000, 960, "s16")
    stereo = frame.to_ndarray().reshape(-1, 2)
    assert np.array_equal(stereo[:, 0], stereo[:, 1])
    return stereo[:, 0]


async def test_items_are_framed_back_to_back_and_counted() -> None:
    playouts: list[TrackEvent] = []
    track = OutboundAudioTrack(on_playout=playouts.append)
    first, second = ramp(1440), ramp(960, start=5000)
    track.enqueue("a", first)
    track.enqueue("b", second)
    assert track.queued_seconds == pytest.approx(2400 / 48000)

    frames = [await next_mono(track) for _ in range(4)]
    assert np.array_equal(np.concatenate(frames)[:2400], np.concatenate([first, second]))
    assert not np.any(np.concatenate(frames)[2400:])  # then silence
    assert (track.sent_ms("a"), track.sent_ms("b"), track.sent_ms("unknown")) == (30, 20, 0)
    assert playouts == [TrackEvent("started", "a"), TrackEvent("started", "b"), TrackEvent("drained", "b")]
    assert track.queued_seconds == 0 and track.frames_sent == 4


async def test_pause_holds_the_queue_and_resume_continues_where_it_paused() -> None:
    track = OutboundAudioTrack()
    audio = ramp(4800)
    track.enqueue("a", audio)
    played = [await next_mono(track)]
    track.pause()
    assert track.paused
    silent = [await next_mono(track) for _ in range(3)]
    assert not np.any(np.concatenate(silent))
    assert track.sent_ms("a") == 20 and track.queued_seconds == pytest.approx(0.08)
    track.resume()
    played += [await next_mono(track) for _ in range(4)]
    assert np.array_equal(np.concatenate(played), audio)
    assert track.sent_ms("a") == 100


async def test_flush_drops_the_queue_but_keeps_what_was_sent() -> None:
    playouts: list[TrackEvent] = []
    track = OutboundAudioTrack(on_playout=playouts.append)
    track.enqueue("a", ramp(4800))
    await next_mono(track)
    await next_mono(track)
    track.pause()
    assert track.flush() == pytest.approx(0.06)
    track.resume()
    assert not np.any(await next_mono(track))
    assert track.sent_ms("a") == 40 and track.queued_seconds == 0
    assert playouts == [TrackEvent("started", "a")]  # a flush is not a drain
    track.release("a")
    assert track.sent_ms("a") == 0


async def test_frames_follow_the_20_ms_schedule_with_contiguous_timestamps() -> None:
    track = OutboundAudioTrack()
    returned, pts = [], []
    begun = time.monotonic()  # frame i's deadline is at least i * 20 ms after this
    for _ in range(10):
        frame = await track.recv()
        returned.append(time.monotonic())
        pts.append(frame.pts)
    assert pts == [i * FRAME_SAMPLES for i in range(10)]
    # Never ahead of its schedule (being late is up to the machine's load, not asserted: a first
    # frame returned late must not make the next ones look early).
    for i, at in enumerate(returned):
        assert at >= begun + i * 0.02 - 0.001


async def test_stopped_track_ends_and_forgets() -> None:
    track = OutboundAudioTrack()
    track.enqueue("a", ramp(960))
    await next_mono(track)
    track.stop()
    assert track.sent_ms("a") == 0 and track.queued_seconds == 0
    track.enqueue("b", ramp(960))
    assert track.queued_seconds == 0
    with pytest.raises(MediaStreamError):
        await track.recv()


def loud(samples: np.ndarray) -> bool:
    return float(np.sqrt(np.mean(samples ** 2))) > 0.05


def quiet(samples: np.ndarray) -> bool:
    return float(np.max(np.abs(samples))) < 0.01


async def test_loopback_pair_plays_pauses_resumes_and_flushes() -> None:
    listener = Recorder()
    server = CallPeer("pacing", LOOPBACK, listener)
    client = ClientPeer(AudioStreamTrack())
    try:
        await client.connect(server)
        track = server.outbound
        track.on_playout = listener.on_playout
        await client.wait_for(lambda: len(client.frames) >= 5)
        assert all(quiet(s) for _, s, _ in client.frames)  # silence while nothing is queued

        seconds = 3.0
        t = np.arange(int(48000 * seconds)) / 48000
        track.enqueue("a", (np.sin(2 * np.pi * 440 * t) * 12000).astype(np.int16))
        await listener.wait_for(lambda: TrackEvent("started", "a") in listener.playouts)
        mark = len(client.frames)
        await client.wait_for(lambda: any(loud(s) for _, s, _ in client.frames[mark:]))

        track.pause()
        sent_at_pause = track.sent_ms("a")
        mark = len(client.frames)
        # Opus and the jitter buffer take a few frames to let the silence through.
        await client.wait_for(lambda: all(quiet(s) for _, s, _ in client.frames[-10:])
                              and len(client.frames) >= mark + 10)
        assert track.sent_ms("a") == sent_at_pause
        assert track.queued_seconds == pytest.approx(seconds - sent_at_pause / 1000, abs=0.001)

        track.resume()
        mark = len(client.frames)
        await client.wait_for(lambda: any(loud(s) for _, s, _ in client.frames[mark:]))
        assert track.sent_ms("a") > sent_at_pause

        track.flush()
        heard = track.sent_ms("a")
        await client.wait_for(lambda: all(quiet(s) for _, s, _ in client.frames[-10:]))
        assert track.sent_ms("a") == heard < seconds * 1000
        assert TrackEvent("drained", "a") not in listener.playouts

        # Every 20 ms of sound arrived as one frame; in silence one frame in DTX_INTERVAL_FRAMES
        # (Opus DTX): RTP timestamps advance by whole frames, and skip only where it was quiet.
        frames = client.frames
        steps = np.diff([p for _, _, p in frames])
        assert np.all(steps % 960 == 0) and np.all((steps >= 960) & (steps <= 960 * DTX_INTERVAL_FRAMES))
        assert all(quiet(before) for (_, before, _), step in zip(frames, steps) if step > 960)
        assert any(step > 960 for step in steps)  # the silence before the tone was sent as DTX
        assert all(len(s) == 960 for _, s, _ in frames)
    finally:
        await client.close()
        await server.close()


def underruns() -> float:
    value = REGISTRY.get_sample_value("duplex_outbound_underruns_total")
    assert value is not None, "duplex_outbound_underruns_total is not exported"
    return value


async def test_running_dry_mid_item_counts_underruns_until_the_item_ends() -> None:
    clock = [0.0]
    track = OutboundAudioTrack(clock=lambda: clock[0])

    async def frame() -> None:
        clock[0] += 0.02
        await track.recv()

    before = underruns()
    track.enqueue("a", np.full(960 * 2, 1000, dtype=np.int16))
    for _ in range(2):
        await frame()
    assert underruns() == before  # two full frames
    await frame()
    await frame()
    assert underruns() == before + 2  # the item is still open: the model is late
    track.pause()
    await frame()
    assert underruns() == before + 2  # a paused track is silent on purpose
    track.resume()
    track.enqueue("a", np.full(480, 1000, dtype=np.int16))
    track.end_item("a")
    await frame()  # half a frame, then the item's end: not an underrun
    await frame()
    assert underruns() == before + 2
    track.stop()
