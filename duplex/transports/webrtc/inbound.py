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

TESTED_AIORTC = "1.16.0"  # the aiortc whose private attributes the swap was written against
_DECODER_QUEUE = "_RTCRtpReceiver__decoder_queue"

logger = logging.getLogger(__name__)
_warned = False


class LoopDecoder:
    """Stands in for an ``RTCRtpReceiver``'s decoder queue (see module doc)."""

    def __init__(self, frames: asyncio.Queue[Any]) -> None:
        self._frames = frames  # the remote track's queue, read by track.recv()
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


def decode_on_loop(receiver: RTCRtpReceiver) -> bool:
    """Swap ``receiver``'s decoder queue for a :class:`LoopDecoder`, before ``receive()`` starts
    it (the ``track`` event is early enough). Returns whether the swap was made."""
    global _warned
    frames = getattr(receiver.track, "_queue", None)
    if not hasattr(receiver, _DECODER_QUEUE) or not isinstance(frames, asyncio.Queue):
        if not _warned:
            _warned = True
            logger.warning("this aiortc (tested: %s) has no decoder queue to swap: inbound audio "
                           "is decoded in aiortc's thread", TESTED_AIORTC)
        return False
    setattr(receiver, _DECODER_QUEUE, LoopDecoder(frames))
    return True
