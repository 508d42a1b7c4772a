"""A client microphone for aiortc test peers: real-time 20 ms frames of scripted audio.

``say`` queues audio (48 kHz float32 mono) after whatever is queued; silence fills the rest. The
returned future resolves when the last sample of that audio has been sent, which is how tests know
"the user stopped speaking" without sleeping.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections import deque

import av
import numpy as np
from aiortc.mediastreams import MediaStreamTrack

RATE = 48000
FRAME = 960


class ScriptedMic(MediaStreamTrack):
    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[tuple[np.ndarray, asyncio.Future[None] | None]] = deque()
        self._start: float | None = None
        self._frames = 0

    def say(self, samples: np.ndarray) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        pcm = (np.clip(samples, -1, 1) * 32767).astype(np.int16)
        self._queue.append((pcm, done))
        return done

    async def recv(self) -> av.AudioFrame:
        now = time.monotonic()
        if self._start is None:
            self._start = now
        wait = self._start + self._frames * FRAME / RATE - now
        if wait > 0:
            await asyncio.sleep(wait)
        out = np.zeros(FRAME, dtype=np.int16)
        filled = 0
        while filled < FRAME and self._queue:
            pcm, done = self._queue[0]
            take = min(FRAME - filled, len(pcm))
            out[filled : filled + take] = pcm[:take]
            filled += take
            if take == len(pcm):
                self._queue.popleft()
                if done is not None and not done.done():
                    done.set_result(None)
            else:
                self._queue[0] = (pcm[take:], done)
        frame = av.AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RATE
        frame.time_base = fractions.Fraction(1, RATE)
        frame.pts = self._frames * FRAME
        self._frames += 1
        return frame
