"""``python -m evaluation.server_probe PROBE_FILE [duplex.serve options]``: the real server, timed.

Runs ``duplex.serve.main`` unchanged, after wrapping a few *public* methods so that each call also
appends a JSON line to PROBE_FILE with ``t`` = ``time.monotonic()`` (CLOCK_MONOTONIC is one clock
for every process on the machine, so the benchmark compares these times with its own client-side
ones). The wrappers only read arguments and results; behaviour and ordering are unchanged, and the
cost is a few microseconds per call. Records (``k``):

- ``event``: ``WebRTCCall.send_event`` of a turn event (the session sends ``speech_stopped`` right at
  its end-of-turn decision), with the call id; ``peer`` maps the call to its outbound track once;
- ``submit`` / ``first_audio``: ``Coordinator.stream`` started (the request is submitted at its
  first step) and yielded its first chunk carrying audio (to the session), with the request id;
- ``transcript`` / ``first_text``: the request's first chunk carrying the recognised words of the
  user (with them) and its first chunk of answer text;
- ``enqueue``: ``OutboundAudioTrack.enqueue`` of an item's first samples, with the request whose
  response task queued them (how a request is tied to a call);
- ``response``: a ``Response`` was made, with its item and request ids (what ties an adopted
  speculative request, streamed by another task, to the item the call plays);
- ``pause`` / ``resume`` / ``flush``: the track's playout controls (a barge-in);
- ``frame``: every frame ``OutboundAudioTrack.recv`` hands to the encoder, audible or silent.

Owned by the benchmark (evaluation/duplex_bench.py) and meant to be replaced by hooks in the
session layer (see that module's docstring); the file lives as long as the server process.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import IO, Any

import numpy as np

from duplex import serve
from duplex.media.paced_track import OutboundAudioTrack
from duplex.session.response import Response
from duplex.transports.webrtc.call import WebRTCCall
from pipeline.coordinator import Coordinator
from pipeline.proto import OmniRequest, OutputChunk

TURN_EVENTS = frozenset({
    "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "response.created",
    "output_audio_buffer.started", "output_audio_buffer.cleared", "response.done",
})


class Probe:
    """Writes the records; ``_request_of`` ties a response task to the request it streams."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._request_of: dict[int, str] = {}
        self._tracks_seen: set[str] = set()
        self._items_seen: set[tuple[str, str]] = set()

    def record(self, kind: str, **fields: Any) -> None:
        self._out.write(json.dumps({"k": kind, "t": time.monotonic(), **fields}) + "\n")

    def install(self) -> None:
        self._wrap_send_event()
        self._wrap_stream()
        self._wrap_track()
        self._wrap_response()

    def _wrap_response(self) -> None:
        original = Response.__init__

        @functools.wraps(original)
        def init(response: Response, *args: Any, **kwargs: Any) -> None:
            original(response, *args, **kwargs)
            self.record("response", item=response.item.id, req=response.request_id)

        Response.__init__ = init  # type: ignore[method-assign]

    def _wrap_send_event(self) -> None:
        original = WebRTCCall.send_event

        @functools.wraps(original)
        def send_event(call: WebRTCCall, event: dict[str, Any]) -> None:
            kind = event.get("type")
            if kind in TURN_EVENTS:
                if call.outbound.id not in self._tracks_seen:
                    self._tracks_seen.add(call.outbound.id)
                    self.record("peer", call=call.id, track=call.outbound.id)
                status = event.get("response", {}).get("status")
                self.record("event", call=call.id, type=kind, status=status)
            original(call, event)

        WebRTCCall.send_event = send_event  # type: ignore[method-assign]

    def _wrap_stream(self) -> None:
        original = Coordinator.stream
        probe = self

        @functools.wraps(original)
        async def stream(
            coordinator: Coordinator, request: OmniRequest
        ) -> AsyncIterator[OutputChunk]:
            task = asyncio.current_task()
            if task is not None:
                probe._request_of[id(task)] = request.request_id
            probe.record("submit", req=request.request_id)
            seen: set[str] = set()
            try:
                async for chunk in original(coordinator, request):
                    probe._firsts(request.request_id, chunk, seen)
                    yield chunk
            finally:
                if task is not None:
                    probe._request_of.pop(id(task), None)

        Coordinator.stream = stream  # type: ignore[method-assign]

    def _firsts(self, request_id: str, chunk: OutputChunk, seen: set[str]) -> None:
        """The request's first transcript, text and audio chunks (``seen``: those recorded)."""
        data = chunk.data
        transcript = data.get("input_transcript")
        if transcript is not None and "transcript" not in seen:
            seen.add("transcript")
            self.record("transcript", req=request_id, text=str(transcript))
        if data.get("text") and "first_text" not in seen:
            seen.add("first_text")
            self.record("first_text", req=request_id)
        audio = data.get("audio")
        if audio is not None and len(audio) and "first_audio" not in seen:
            seen.add("first_audio")
            self.record("first_audio", req=request_id, stage=chunk.stage)

    def _wrap_track(self) -> None:
        enqueue, recv = OutboundAudioTrack.enqueue, OutboundAudioTrack.recv

        @functools.wraps(enqueue)
        def wrapped_enqueue(track: OutboundAudioTrack, item_id: str, samples: np.ndarray) -> None:
            if len(samples) and (track.id, item_id) not in self._items_seen:
                self._items_seen.add((track.id, item_id))
                task = asyncio.current_task()
                self.record("enqueue", track=track.id, item=item_id,
                            req=self._request_of.get(id(task)) if task is not None else None)
            enqueue(track, item_id, samples)

        @functools.wraps(recv)
        async def wrapped_recv(track: OutboundAudioTrack) -> Any:
            frame = await recv(track)
            self.record("frame", track=track.id, audible=bool(np.any(frame.to_ndarray())))
            return frame

        OutboundAudioTrack.enqueue = wrapped_enqueue  # type: ignore[method-assign]
        OutboundAudioTrack.recv = wrapped_recv  # type: ignore[method-assign]
        for name in ("pause", "resume", "flush"):
            original = getattr(OutboundAudioTrack, name)
            setattr(OutboundAudioTrack, name, self._control(name, original))

    def _control(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def control(track: OutboundAudioTrack) -> Any:
            self.record(name, track=track.id)
            return original(track)

        return control


def main() -> None:
    path, argv = sys.argv[1], sys.argv[2:]
    # Line-buffered: whatever happens to the server, the benchmark reads every record written.
    with open(path, "w", buffering=1) as out:
        Probe(out).install()
        serve.main(argv)


if __name__ == "__main__":
    main()
