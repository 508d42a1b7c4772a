"""Inbound audio decoded on the event loop, not in aiortc's decoder thread.

aiortc's ``RTCRtpReceiver`` puts each encoded frame its jitter buffer completes on a
``queue.Queue`` for a decoder thread, and that thread hands every decoded frame back to the loop
with ``asyncio.run_coroutine_threadsafe`` (a self-pipe write, a Task and a thread wake-up per
20 ms frame, and the GIL passed back and forth each time). For a 20 ms Opus frame the round trip
cost more CPU than the decoding itself, so :func:`decode_on_loop` gives the receiver a
:class:`LoopDecoder` in place of that queue: ``put`` decodes the frame at once, on the loop that
called it, with aiortc's own decoder for the codec (the same frames, in the same order) and puts
the frames on the remote track's queue, where ``track.recv()`` finds them as before.

aiortc offers no extension point for this: the receiver's decoder queue and the track's frame
queue are private attributes (``RTCRtpReceiver.__decoder_queue``, ``RemoteStreamTrack._queue``),
so the swap is a patch, tested against the installed aiortc (``TESTED_AIORTC``,
tests/media/test_inbound_decoding.py). When a receiver lacks either attribute, the swap is skipped
(logged once) and aiortc's thread decodes as before.

Each frame is charged to the call's :class:`~duplex.media.inbound_budget.RealTimeBudget` before
it is decoded, by the media time it holds (:func:`frame_seconds`): a peer that sends faster than
real time has the excess dropped, undecoded, and counted (``transport="webrtc"``).

aiortc still starts its decoder thread; it blocks in :meth:`LoopDecoder.get` until the receiver
stops, puts ``None`` and that call returns ``None``: the thread then ends the track exactly as it
does with its own queue. A LoopDecoder belongs to one receiver; its decoder lives as long as the
receiver and is dropped with it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import av
from aiortc import RTCRtpReceiver
from aiortc.codecs import get_decoder
from aiortc.codecs.base import Decoder
from aiortc.jitterbuffer import JitterFrame
from aiortc.rtcrtpparameters import RTCRtpCodecParameters

from duplex.media.inbound_budget import RealTimeBudget

TESTED_AIORTC = "1.16.0"  # the aiortc whose private attributes the swap was written against
_DECODER_QUEUE = "_RTCRtpReceiver__decoder_queue"

logger = logging.getLogger(__name__)
_warned = False


class LoopDecoder:
    """Stands in for an ``RTCRtpReceiver``'s decoder queue (see module doc)."""

    def __init__(self, frames: asyncio.Queue[Any], budget: RealTimeBudget | None = None) -> None:
        self._frames = frames  # the remote track's queue, read by track.recv()
        # None: every frame is decoded, however fast it comes (as aiortc's own worker does).
        self._budget = budget
        self._codec: str | None = None
        self._decoder: Decoder | None = None
        self._stopped = threading.Event()

    def put(self, task: tuple[RTCRtpCodecParameters, JitterFrame] | None) -> None:
        """Called by the receiver on the loop: a frame to decode, or None when it stops."""
        if task is None:
            self._decoder = None
            self._stopped.set()
            return
        codec, encoded_frame = task
        if self._budget is not None and not self._budget.admit(frame_seconds(codec, encoded_frame.data)):
            return
        if self._decoder is None or codec.name != self._codec:
            self._decoder, self._codec = get_decoder(codec), codec.name
        try:
            frames = self._decoder.decode(encoded_frame)
        except av.FFmpegError as exc:  # as aiortc's worker: keep the decoder state, go on
            logger.warning("failed to decode a %s frame: %s", codec.name, exc)
            return
        for frame in frames:
            self._frames.put_nowait(frame)

    def get(self) -> None:
        """Called by aiortc's decoder thread: blocks until the receiver stops, then None."""
        self._stopped.wait()


# Frame durations of an Opus packet's TOC configuration (RFC 6716 §3.1), in 2.5 ms units: SILK
# 10/20/40/60 ms (configs 0-11), hybrid 10/20 ms (12-15), CELT 2.5/5/10/20 ms (16-31).
_OPUS_FRAME_UNITS = [4, 8, 16, 24] * 3 + [4, 8] * 2 + [1, 2, 4, 8] * 4
FALLBACK_SECONDS = 0.02  # what a packet of a codec we cannot measure is charged: one usual frame


def frame_seconds(codec: RTCRtpCodecParameters, data: bytes) -> float:
    """The media time an encoded audio frame holds, from its bytes alone (before decoding). No
    library reads an Opus packet's duration without decoding it (libopus's
    ``opus_packet_get_nb_samples`` is not exposed by PyAV or aiortc): the TOC byte says it."""
    name = codec.name.lower()
    if name == "opus" and data:
        count = data[0] & 0x03  # frames in the packet: 1, 2, 2, or given by the next byte
        frames = (1, 2, 2)[count] if count < 3 else (data[1] & 0x3F if len(data) > 1 else 0)
        # A packet of no frames (malformed) still costs a decode attempt: one frame's worth.
        return max(frames, 1) * _OPUS_FRAME_UNITS[data[0] >> 3] * 0.0025
    if name in ("pcmu", "pcma", "g722"):
        return len(data) / 8000  # 8000 bytes a second: G.711 a byte a sample, G.722 at 64 kbit/s
    return FALLBACK_SECONDS


def decode_on_loop(receiver: RTCRtpReceiver, log: logging.Logger | logging.LoggerAdapter = logger) -> bool:
    """Swap ``receiver``'s decoder queue for a :class:`LoopDecoder` with a real-time budget (its
    drops logged on ``log``: the call's), before ``receive()`` starts it (the ``track`` event is
    early enough). Returns whether the swap was made."""
    global _warned
    frames = getattr(receiver.track, "_queue", None)
    if not hasattr(receiver, _DECODER_QUEUE) or not isinstance(frames, asyncio.Queue):
        if not _warned:
            _warned = True
            logger.warning("this aiortc (tested: %s) has no decoder queue to swap: inbound audio "
                           "is decoded in aiortc's thread", TESTED_AIORTC)
        return False
    setattr(receiver, _DECODER_QUEUE, LoopDecoder(frames, RealTimeBudget("webrtc", log)))
    return True
