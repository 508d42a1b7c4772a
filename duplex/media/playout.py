"""Where a session's agent audio goes: the AgentAudio contract and its two implementations.

This is the one object in which the two kinds of transport differ:

- ``PacedPlayout`` (WebRTC, SIP): the server plays the audio out in real time from a paced
  sender's frame queue, so
  it knows exactly what the user heard, can pause, resume and clear it at the next 20 ms frame, and
  an answer is over once its last sample was played. It sends ``output_audio_buffer.started``,
  ``.stopped`` and ``.cleared``.
- ``ClientPlayout`` (Realtime WebSocket, Twilio): the audio leaves as ``response.output_audio.delta``
  events in the session's output format and the client plays it; the server counts what it sent,
  and an answer is over once its last chunk was sent.

An AgentAudio belongs to one session and lives as long as it; it plays one response's item at a
time (``begin`` … ``finish``), and reports to the session through its ``listener``. Per-item
counters are dropped by ``finish``; ``close`` (the session closed) drops the rest.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import numpy as np

from duplex.media.frame_queue import FrameQueue, TrackEvent
from duplex.media.resample import Resampler
from duplex.protocol.events import event
from duplex.protocol.wire_audio import OutboundEncoder


class PlayoutListener(Protocol):
    """What an AgentAudio reports to its session (on the event loop; must not block)."""

    def send(self, message: dict[str, Any]) -> None:
        """Send a server event to the client."""

    def on_playout_started(self, item_id: str) -> None:
        """The first samples of ``item_id`` reached the user (paced) or were sent (client)."""


class AudioTap(Protocol):
    """Where the agent's audio goes as the caller hears it (a call's recording): on the event
    loop, monotonic times; must not block."""

    def agent_played(self, samples: np.ndarray, rate: int, at: float) -> None:
        """``samples`` were played from ``at`` on."""

    def agent_sent(self, samples: np.ndarray, rate: int, at: float) -> None:
        """``samples`` were sent at ``at`` to a client that plays them after what it has."""

    def cut_agent(self, at: float) -> None:
        """The client stopped playing at ``at``: what it was sent and had not played yet never
        played (a Realtime client stops at ``input_audio_buffer.speech_started``)."""


class AgentAudio(Protocol):
    paces_playout: bool
    """True when the server plays the audio out in real time and knows what was heard."""

    listener: PlayoutListener | None

    tap: AudioTap | None
    """Told what the caller heard (None: nobody records)."""

    def begin(self, response_id: str, item_id: str, output_format: str) -> None:
        """A response's audio item starts; ``output_format`` is the session's wire format."""

    def play(self, samples: np.ndarray, sample_rate: int) -> None:
        """Queue (paced) or send (client) float32 mono samples of the current item."""

    async def drain(self) -> None:
        """No more audio will come: return once the item was played out (paced) or sent."""

    def end_part(self) -> None:
        """The item's audio part is complete (before the response's closing events)."""

    def finish(self, completed: bool) -> None:
        """``response.done`` went out (``completed`` or not): closing events, counters released."""

    def pause(self) -> None:
        """Hold the audio from the next frame on (a possible interruption)."""

    def resume(self) -> None:
        """Carry on where ``pause`` held it (a false interruption)."""

    def clear(self) -> None:
        """Drop everything queued (a confirmed interruption, ``output_audio_buffer.clear``)."""

    def heard_ms(self) -> int:
        """Milliseconds of the current item played out (paced) or sent (client); 0 when idle."""

    def queued_seconds(self) -> float:
        """Audio waiting to be played out."""

    def close(self) -> None:
        """The session closed: forget the item, the listener and the resampler; play nothing more.
        What the session owns must not refer back to it once it closed (see ``Session._let_go``)."""


class _Item:
    """The item being played: its ids and whether its audio reached the user yet."""

    def __init__(self, response_id: str, item_id: str) -> None:
        self.response_id = response_id
        self.id = item_id
        self.started = False
        self.samples = 0


class PacedPlayout:
    """The agent's audio on a paced sender's :class:`FrameQueue` (see module doc)."""

    paces_playout = True

    def __init__(self, track: FrameQueue) -> None:
        self.track = track
        self.listener: PlayoutListener | None = None
        self._resampler: Resampler | None = None
        self._item: _Item | None = None
        self._last_response: str | None = None  # the response whose audio went out last
        self._played = asyncio.Event()  # set when the queue ran dry or was cleared
        self.tap: AudioTap | None = None
        track.on_playout = self._on_track
        track.on_frame = self._on_frame

    def _send(self, kind: str) -> None:
        # The GA events name a response; a clear with nothing ever played has none to name.
        if self.listener is not None and self._last_response is not None:
            self.listener.send(event(kind, response_id=self._last_response))

    def begin(self, response_id: str, item_id: str, output_format: str) -> None:
        self._item = _Item(response_id, item_id)
        self._last_response = response_id

    def play(self, samples: np.ndarray, sample_rate: int) -> None:
        if self._item is None:
            return
        if self._resampler is None or self._resampler.in_rate != sample_rate:
            self._resampler = Resampler(sample_rate, self.track.rate, out_dtype=np.int16)
        self._item.samples += len(samples)
        self.track.enqueue(self._item.id, self._resampler.push(samples))

    async def drain(self) -> None:
        item = self._item
        if item is None or not item.samples:
            return
        if self._resampler is not None:
            self.track.enqueue(item.id, self._resampler.flush())
        self.track.end_item(item.id)
        while self.track.queued_seconds > 0:
            self._played.clear()
            await self._played.wait()

    def end_part(self) -> None:
        """The paced buffer's own events tell the client when the audio started and stopped."""

    def finish(self, completed: bool) -> None:
        item = self._item
        if item is None:
            return
        if completed and item.samples:
            self._send("output_audio_buffer.stopped")
        self.track.release(item.id)
        self._item = None

    def pause(self) -> None:
        self.track.pause()

    def resume(self) -> None:
        self.track.resume()

    def clear(self) -> None:
        self.track.flush()
        if self._resampler is not None:
            self._resampler.flush()
        self._played.set()
        self._send("output_audio_buffer.cleared")

    def heard_ms(self) -> int:
        return 0 if self._item is None else self.track.sent_ms(self._item.id)

    def queued_seconds(self) -> float:
        return self.track.queued_seconds

    def close(self) -> None:
        self.finish(False)
        self.listener = None
        self._resampler = None
        # The track may outlive the call (aiortc's sender holds it): it must not hold this.
        self.track.on_playout = None
        self.track.on_frame = None
        self.tap = None

    def _on_frame(self, samples: np.ndarray) -> None:
        """A frame went to the sender: the caller hears it now."""
        if self.tap is not None:
            self.tap.agent_played(samples, self.track.rate, time.monotonic())

    def _on_track(self, track_event: TrackEvent) -> None:
        item = self._item
        if track_event.kind == "drained":
            self._played.set()
        elif item is not None and track_event.item_id == item.id and not item.started:
            item.started = True
            self._send("output_audio_buffer.started")
            if self.listener is not None:
                self.listener.on_playout_started(item.id)


class ClientPlayout:
    """The agent's audio as ``response.output_audio.delta`` events (see module doc)."""

    paces_playout = False

    def __init__(self) -> None:
        self.listener: PlayoutListener | None = None
        self.tap: AudioTap | None = None
        self._format = "audio/pcm"
        self._item: _Item | None = None
        self._encoder: OutboundEncoder | None = None
        self._sent_ms = 0

    def _send(self, kind: str, **fields: Any) -> None:
        if self.listener is not None and self._item is not None:
            self.listener.send(event(kind, response_id=self._item.response_id, item_id=self._item.id,
                                     output_index=0, content_index=0, **fields))

    def begin(self, response_id: str, item_id: str, output_format: str) -> None:
        self._item = _Item(response_id, item_id)
        self._format = output_format
        self._encoder = None
        self._sent_ms = 0

    def play(self, samples: np.ndarray, sample_rate: int) -> None:
        item, encoder = self._item, self._encoder
        if item is None or not len(samples):
            return
        if encoder is None or sample_rate != encoder.in_rate:
            encoder = self._encoder = OutboundEncoder(self._format, sample_rate)
        item.samples += len(samples)
        self._sent_ms = item.samples * 1000 // sample_rate
        delta, _ = encoder.encode(samples)
        self._send("response.output_audio.delta", delta=delta)
        if self.tap is not None:
            self.tap.agent_sent(samples, sample_rate, time.monotonic())
        if not item.started:
            item.started = True
            if self.listener is not None:
                self.listener.on_playout_started(item.id)

    async def drain(self) -> None:
        """Every chunk was sent as it came: nothing to wait for."""

    def end_part(self) -> None:
        self._send("response.output_audio.done")

    def finish(self, completed: bool) -> None:
        self._item = None
        self._encoder = None

    def pause(self) -> None:
        """The client owns playback: it stops it on ``speech_started``."""

    def resume(self) -> None:
        """The client owns playback."""

    def clear(self) -> None:
        """Nothing is queued on the server."""

    def heard_ms(self) -> int:
        return self._sent_ms if self._item is not None else 0

    def queued_seconds(self) -> float:
        return 0.0

    def close(self) -> None:
        self.finish(False)
        self.listener = None
        self.tap = None
