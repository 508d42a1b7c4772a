"""The paced outbound audio track: the agent's voice, one 20 ms frame every 20 ms.

:class:`OutboundAudioTrack` is an aiortc ``MediaStreamTrack``. aiortc's sender calls ``recv()`` in
a loop; each call waits for the next 20 ms deadline on the monotonic clock and returns a 48 kHz s16
frame of 960 samples, taken from the queue, or silence when the queue is empty or paused
(DESIGN.md invariant 6: the media path never waits on a model, and the receiver never sees a gap).
The voice is mono, sent as identical stereo channels: that is the layout aiortc's Opus encoder
wants, so its resampler passes the frames through instead of remixing them at -3 dB.

:class:`OpusPacketTrack` wraps the track when the call negotiated Opus and hands aiortc's sender
Opus packets instead of frames — a ``MediaStreamTrack.recv`` may return either, and aiortc sends a
packet as it is. That takes the encoder off aiortc's thread pool (a hand-off per frame both ways)
and skips aiortc's pure-Python RFC 6464 audio-level loop over every sample (packets go out without
the audio-level header extension, which browsers do not need); the track then makes mono frames,
encoded mono at a complexity chosen by measurement (``evaluation/webrtc_media_cpu.py``), and
repeats libopus's constant packet for digital silence instead of encoding it again.

While the agent is silent it sends what Opus DTX sends (RFC 7587 §3.1.3; WebRTC does the same): a
one-byte packet (the TOC byte alone, a frame with no data, which decoders conceal as silence)
every 400 ms instead of a packet every 20 ms. The RTP timestamps still follow the paced schedule
and the sequence numbers stay consecutive, so a receiver sees a pause in the talk, not a loss;
the first frame of speech goes out in its own 20 ms slot. That saves the sender's per-packet work
(RTP, SRTP, the socket) for 19 of every 20 silent frames (``evaluation/call_cpu.py``); Chromium
plays the answers that follow (tests/web/test_browser_e2e.py).

The queue itself (items, pause / resume / flush, what was sent of each item) is a
:class:`~duplex.media.frame_queue.FrameQueue`; the track adds the 20 ms pacing and aiortc's frame
format. ``stop()`` (the peer closing) drops everything.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections.abc import Callable

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from duplex import metrics
from duplex.media.frame_queue import FrameQueue, TrackEvent

SAMPLE_RATE = 48000
FRAME_SAMPLES = 960  # 20 ms at 48 kHz: one Opus frame, so aiortc's encoder never re-frames
FRAME_SECONDS = FRAME_SAMPLES / SAMPLE_RATE
TIME_BASE = fractions.Fraction(1, SAMPLE_RATE)
# Behind schedule by more than this (a stalled loop, a suspended host), the track restarts its
# schedule from now instead of bursting out every missed frame: a burst longer than the remote
# jitter buffer (~80 ms in aiortc) would only be dropped there.
MAX_LAG_SECONDS = 0.2
# Opus settings of OpusPacketTrack. aiortc's own encoder: stereo, 96 kbit/s, complexity 10. The
# bit rate stays aiortc's (now all of it for the one channel there is); the complexity is the
# measured choice of evaluation/webrtc_media_cpu.py (encoder CPU against what a recogniser hears).
OPUS_BITRATE = 96000
OPUS_COMPLEXITY = 5
# While silent, one DTX packet every this many frames: 400 ms, as libopus's DTX and WebRTC's.
DTX_INTERVAL_FRAMES = 20
_SILENCE = {channels: bytes(2 * FRAME_SAMPLES * channels) for channels in (1, 2)}  # s16 frames

logger = logging.getLogger(__name__)


class OutboundAudioTrack(FrameQueue, MediaStreamTrack):
    """Paced 48 kHz s16 outbound audio from a :class:`FrameQueue` (see module doc)."""

    kind = "audio"

    def __init__(
        self,
        on_playout: Callable[[TrackEvent], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        channels: int = 2,
    ) -> None:
        """``clock``: the pacing clock (tests drive the track on virtual time with their own);
        ``channels``: 2 (identical) for aiortc's own encoder, 1 for :class:`OpusPacketTrack`."""
        MediaStreamTrack.__init__(self)
        self.channels = channels
        FrameQueue.__init__(self, SAMPLE_RATE, FRAME_SAMPLES, on_playout)
        self._clock = clock
        self._last_frame_at: float | None = None  # clock time the previous frame was returned
        self._start: float | None = None  # clock time of frame 0's deadline
        self._frames = 0  # frames returned so far (the pts of the next one, in frames)
        self._schedule = 0  # frames since self._start, the schedule's own count
        # Whether recv's last frame is silence the track made (nothing to send, or paused), not
        # queued audio: OpusPacketTrack then knows it silent without reading its samples.
        self.made_silence = False

    @property
    def frames_sent(self) -> int:
        return self._frames

    def stop(self) -> None:
        self.close()
        super().stop()

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = self._clock()
        if self._start is None or now - self._deadline() > MAX_LAG_SECONDS:
            if self._start is not None:
                logger.warning("outbound audio %.0f ms behind schedule: restarting it",
                               (now - self._deadline()) * 1000)
            self._start, self._schedule = now, 0
        wait = self._deadline() - now
        if wait > 0:
            await asyncio.sleep(wait)
        # Read the queue only now, after the wait, so that a pause or flush made while waiting
        # already applies to this frame.
        samples = self.next_frame()
        self.made_silence = samples is None
        if samples is None:
            frame = self._silence()
        elif self.channels == 2:
            frame = av.AudioFrame.from_ndarray(
                np.repeat(samples, 2).reshape(1, -1), format="s16", layout="stereo"
            )
        else:
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = SAMPLE_RATE
        frame.time_base = TIME_BASE
        frame.pts = self._frames * FRAME_SAMPLES
        self._frames += 1
        self._schedule += 1
        returned = self._clock()
        if self._last_frame_at is not None:
            metrics.OUTBOUND_FRAME_GAP_SECONDS.observe(returned - self._last_frame_at)
        self._last_frame_at = returned
        return frame

    def _silence(self) -> av.AudioFrame:
        """A silent frame, zeroed in place: half the cost of one made from a numpy array."""
        layout = "stereo" if self.channels == 2 else "mono"
        frame = av.AudioFrame(format="s16", layout=layout, samples=FRAME_SAMPLES)
        frame.planes[0].update(_SILENCE[self.channels])
        return frame

    def _deadline(self) -> float:
        assert self._start is not None
        return self._start + self._schedule * FRAME_SECONDS


class OpusPacketTrack(MediaStreamTrack):
    """The paced track's frames as Opus packets, for aiortc's sender to send as they are.

    Owns its encoder, and its source track from :meth:`__init__` (which switches the source to
    mono frames) until :meth:`stop`, which stops the source too. One per call, like the source.
    """

    kind = "audio"

    def __init__(self, source: OutboundAudioTrack, complexity: int = OPUS_COMPLEXITY,
                 dtx: bool = True) -> None:
        super().__init__()
        source.channels = 1
        self.source = source
        self._encoder = opus_encoder(complexity)
        self._dtx = dtx
        self._quiet = 0  # frames of settled silence so far (DTX sends one packet in 20 of them)
        # libopus codes digital silence as one constant 3-byte packet once its state has settled
        # (the second silent frame on). Encoding a silent frame costs as much as speech, so while
        # the agent is quiet that packet is repeated instead. The listener's decoder gets the very
        # same packets; only the encoder's slow analysis state sees less silence, which changed one
        # packet of the speech after 1.2 s of silence, by a few LSB once decoded
        # (tests/duplex/test_media_cpu_paths.py).
        self._silent_packet: bytes | None = None  # the settled silence packet, while silent
        self._last_silent: bytes | None = None  # the previous frame's packet, when it was silent

    def stop(self) -> None:
        self.source.stop()
        super().stop()

    async def recv(self) -> av.Packet:
        frame = await self.source.recv()
        while (data := self._packet(frame)) is None:
            frame = await self.source.recv()  # a silent frame DTX skips: on to the next 20 ms
        packet = av.Packet(data)
        packet.pts = frame.pts  # RTP timestamps follow the paced schedule, as with frames
        packet.time_base = TIME_BASE
        return packet

    def _packet(self, frame: av.AudioFrame) -> bytes | None:
        """The packet to send for ``frame``; None for a silent frame that DTX skips."""
        # The mono s16 plane read in place: PyAV's to_ndarray would copy it through numpy.vstack.
        if (not self.source.made_silence
                and np.frombuffer(frame.planes[0], np.int16, frame.samples).any()):
            self._last_silent = self._silent_packet = None
            self._quiet = 0
            return self._encode(frame)
        if self._silent_packet is None:
            data = self._encode(frame)
            if data == self._last_silent:
                self._silent_packet = data
            self._last_silent = data
            return data
        if not self._dtx:
            return self._silent_packet
        self._quiet += 1
        return self._silent_packet[:1] if self._quiet % DTX_INTERVAL_FRAMES == 1 else None

    def _encode(self, frame: av.AudioFrame) -> bytes:
        packets = self._encoder.encode(frame)
        assert len(packets) == 1, "libopus codes each 20 ms frame into one packet"
        return bytes(packets[0])


def opus_encoder(complexity: int = OPUS_COMPLEXITY) -> av.CodecContext:
    """A mono libopus encoder for 20 ms s16 frames at 48 kHz; one per stream (it keeps state)."""
    codec = av.CodecContext.create("libopus", "w")
    codec.bit_rate = OPUS_BITRATE
    codec.format = "s16"
    codec.layout = "mono"
    codec.sample_rate = SAMPLE_RATE
    codec.time_base = TIME_BASE
    # "voip" as aiortc's own encoder; compression_level is libopus's complexity (0-10).
    codec.options = {"application": "voip", "compression_level": str(complexity)}
    return codec
