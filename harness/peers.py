"""Test doubles around real aiortc peers: a recording listener and a browser-like client peer."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from duplex.media.frame_queue import TrackEvent
from duplex.transports.webrtc.ice import IcePolicy
from duplex.transports.webrtc.peer import EVENTS_CHANNEL, CallPeer

LOOPBACK = IcePolicy(hosts=("127.0.0.1",))
TIMEOUT = 20.0


class Changes:
    """Wake waiters whenever something was recorded; they re-check their condition."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()

    def notify(self) -> None:
        self._changed.set()

    async def wait_for(self, condition: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
        async with asyncio.timeout(timeout):
            while not (result := condition()):
                self._changed.clear()
                await self._changed.wait()
        return result


class Recorder(Changes):
    """A PeerListener that keeps everything the peer reports (and, as ``on_playout``, what a
    track it is attached to reports)."""

    def __init__(self) -> None:
        super().__init__()
        self.audio: list[tuple[np.ndarray, float]] = []
        self.messages: list[str | bytes] = []
        self.playouts: list[TrackEvent] = []
        self.closed: list[str] = []

    def on_audio(self, samples: np.ndarray, arrival: float) -> None:
        self.audio.append((samples, arrival))
        self.notify()

    def on_message(self, message: str | bytes) -> None:
        self.messages.append(message)
        self.notify()

    def on_playout(self, event: TrackEvent) -> None:
        self.playouts.append(event)
        self.notify()

    def on_closed(self, reason: str) -> None:
        self.closed.append(reason)
        self.notify()


class ClientPeer(Changes):
    """A client as a browser runs it: sends ``track`` (and ``video``, where given), opens
    ``oai-events``, plays what it gets.

    ``frames`` holds each received audio frame as (arrival, first channel as float32, pts).
    """

    def __init__(self, track: MediaStreamTrack, policy: IcePolicy = LOOPBACK,
                 video: MediaStreamTrack | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.pc = RTCPeerConnection(policy.configuration())
        self.pc.addTrack(track)
        if video is not None:  # a camera beside the microphone
            self.pc.addTrack(video)
        self.channel = self.pc.createDataChannel(EVENTS_CHANNEL)
        self.messages: list[str] = []
        self.frames: list[tuple[float, np.ndarray, int]] = []
        self._reader: asyncio.Task[None] | None = None
        self.channel.on("message", self._on_message)
        self.pc.on("track", self._on_track)

    async def offer(self) -> str:
        self.policy.restrict(self.pc)
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def connect(self, server: CallPeer) -> str:
        """Offer, let ``server`` answer, wait until the events channel is open; the answer."""
        answer = await server.answer(await self.offer())
        await self.pc.setRemoteDescription(
            RTCSessionDescription(self.policy.filter_candidates(answer), "answer")
        )
        self.channel.on("open", self.notify)
        await self.wait_for(lambda: self.channel.readyState == "open")
        return answer

    def send(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(m) for m in self.messages]

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self.pc.close()

    def _on_message(self, message: str) -> None:
        self.messages.append(message)
        self.notify()

    def _on_track(self, track: MediaStreamTrack) -> None:
        self._reader = asyncio.create_task(self._read(track))

    async def _read(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            samples = frame.to_ndarray().reshape(-1, len(frame.layout.channels))[:, 0]
            self.frames.append((time.monotonic(), samples.astype(np.float32) / 32768, frame.pts))
            self.notify()
