"""The agent's audio for a client that plays what it receives and says how far it got with marks
(Twilio Media Streams): an AgentAudio that knows what the caller heard.

The server cannot stop audio it already sent, so it sends the answer as it comes, each chunk
followed by a mark named after the item and the audio time at its end, and the client echoes each
mark when its playback reaches it. What the caller heard is the last echoed mark. Holding the audio
(a possible interruption) sends ``clear``, which drops everything the client has not played yet;
resuming (a false interruption) sends again everything after the last echoed mark. Clearing (a
confirmed interruption) sends ``clear`` and forgets it.

The client plays what it has in order, so a chunk starts as the one before it ends (that one's
mark, or the item's first mark, comes back) or, when the client had played everything before it,
as it arrives (it is sent). The ``tap`` (the session's echo canceller, then a call's recording)
is told each chunk then, as it starts: a canceller must have the agent's audio before its echo
comes back, and a chunk's own mark comes back only once the whole chunk was played (a chunk can
be a second long).

A MarkedPlayout belongs to one session (one media stream); the chunks it keeps are those sent
and not yet acknowledged, dropped as marks come back, when the item ends and at ``close``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from duplex.media.pcm import float_to_pcm16
from duplex.media.playout import AudioTap, PlayoutListener
from duplex.media.resample import Resampler


class MarkedPlayout:
    """See module doc. ``send_media(samples)`` sends 8 kHz int16 audio to the client,
    ``send_mark(name)`` a mark, ``send_clear()`` a clear; all three must not block."""

    paces_playout = True  # it knows what was heard and can hold the audio

    def __init__(self, rate: int, send_media: Callable[[np.ndarray], None],
                 send_mark: Callable[[str], None], send_clear: Callable[[], None]) -> None:
        self.rate = rate
        self.listener: PlayoutListener | None = None
        self.tap: AudioTap | None = None
        self._send_media = send_media
        self._send_mark = send_mark
        self._send_clear = send_clear
        self._resampler: Resampler | None = None
        self._item: str | None = None
        self._sent = 0  # samples of the item sent (or held while paused)
        self._heard = 0  # samples of the item the client played (the last echoed mark)
        self._started = False
        self._told = 0  # samples of the item the tap was told are playing (or played)
        self._unplayed: deque[tuple[int, np.ndarray]] = deque()  # (end sample, chunk) not echoed
        self._paused = False
        self._played = asyncio.Event()

    def _mark(self, end: int) -> str:
        return f"{self._item}:{end}"

    def begin(self, response_id: str, item_id: str, output_format: str) -> None:
        self._item, self._sent, self._heard, self._started = item_id, 0, 0, False
        self._told = 0
        self._unplayed.clear()

    def play(self, samples: np.ndarray, sample_rate: int) -> None:
        if self._item is None:
            return
        if self._resampler is None or self._resampler.in_rate != sample_rate:
            self._resampler = Resampler(sample_rate, self.rate)
        chunk = float_to_pcm16(self._resampler.push(samples))
        if not len(chunk):
            return
        if self._sent == 0:
            self._send_mark(self._mark(0))  # echoed when the first sample plays
        self._sent += len(chunk)
        self._unplayed.append((self._sent, chunk))
        if not self._paused:
            self._send(chunk, self._sent)
            self._tell_started()

    def _tell_started(self) -> None:
        """Tell the tap that the chunk after the last echoed mark plays from now, once (module
        doc): called as a mark comes back and as a chunk is sent (or sent again). Not before the
        item's first mark came back: the first chunk starts then, which may be well after it
        was sent."""
        if self.tap is None or self._paused or not self._started or not self._unplayed:
            return
        end, chunk = self._unplayed[0]
        if end > self._told:
            self._told = end
            self.tap.agent_played(chunk, self.rate, time.monotonic())

    def _send(self, chunk: np.ndarray, end: int) -> None:
        self._send_media(chunk)
        self._send_mark(self._mark(end))

    def on_mark(self, name: str) -> None:
        """The client played up to the mark ``name``."""
        item, _, end = name.rpartition(":")
        if item != self._item or not end.isdigit():
            return
        self._heard = max(self._heard, int(end))
        while self._unplayed and self._unplayed[0][0] <= self._heard:
            self._unplayed.popleft()
        first, self._started = not self._started, True
        self._tell_started()
        if first and self.listener is not None:
            self.listener.on_playout_started(item)
        if not self._unplayed:
            self._played.set()

    async def drain(self) -> None:
        if self._item is None or not self._sent:
            return
        if self._resampler is not None:
            tail = float_to_pcm16(self._resampler.flush())
            if len(tail):
                self._sent += len(tail)
                self._unplayed.append((self._sent, tail))
                if not self._paused:
                    self._send(tail, self._sent)
                    self._tell_started()
        while self._unplayed:
            self._played.clear()
            await self._played.wait()

    def end_part(self) -> None:
        """The marks tell the client nothing more: nothing to close."""

    def finish(self, completed: bool) -> None:
        self._item = None
        self._unplayed.clear()

    def pause(self) -> None:
        self._paused = True
        self._send_clear()

    def resume(self) -> None:
        self._paused = False
        for end, chunk in self._unplayed:
            self._send(chunk, end)
        self._told = self._heard  # the client plays them all again, from the first
        self._tell_started()

    def clear(self) -> None:
        self._send_clear()
        self._unplayed.clear()
        if self._resampler is not None:
            self._resampler.flush()
        self._played.set()

    def heard_ms(self) -> int:
        return self._heard * 1000 // self.rate if self._item is not None else 0

    def queued_seconds(self) -> float:
        return (self._sent - self._heard) / self.rate if self._item is not None else 0.0

    def close(self) -> None:
        self.finish(False)
        self.listener = None
        self.tap = None
        self._resampler = None
        # The three senders are the connection's, which owns this playout: let go of them.
        self._send_media = self._send_mark = self._send_clear = _closed


def _closed(*_: object) -> None:
    """What a closed playout sends with: nothing."""
