"""A client microphone for aiortc test peers: the paced outbound track, fed with scripted speech.

``say`` queues audio (48 kHz float32 mono) after whatever is queued; silence fills the rest. The
returned future resolves when the last sample of that audio has been sent, which is how tests know
"the user stopped speaking" without sleeping.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np

from duplex.media.frame_queue import TrackEvent
from duplex.media.paced_track import OutboundAudioTrack
from duplex.media.pcm import float_to_pcm16


class ScriptedMic(OutboundAudioTrack):
    def __init__(self) -> None:
        super().__init__(on_playout=self._on_playout)
        self._ids = itertools.count()
        self._waiting: list[asyncio.Future[None]] = []

    def say(self, samples: np.ndarray) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.enqueue(f"say-{next(self._ids)}", float_to_pcm16(samples))
        self._waiting.append(done)
        return done

    def _on_playout(self, playout: TrackEvent) -> None:
        if playout.kind == "drained":
            for done in self._waiting:
                if not done.done():
                    done.set_result(None)
            self._waiting.clear()
