"""Long client audio is decoded off the event loop, in order, and the VAD runs over it in slices;
audio beyond the caps or the budget is refused before any of it is decoded.

A session behind a real SessionBinding (events handed over one at a time, as every transport
does), without a model: items and appends need none. The decode is held on a gate to see where it
runs and what waits for it; nothing here reads a clock.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import threading
from typing import Any

import numpy as np
import pytest

from duplex.media.playout import ClientPlayout
from duplex.protocol import wire_audio
from duplex.registry import SessionRegistry
from duplex.session.client_events import (
    HELD_BYTES_PER_S,
    ITEM_AUDIO_BURST_S,
    MAX_CLIENT_AUDIO_BYTES,
    OFF_LOOP_MIN_S,
    VAD_SLICE,
)
from duplex.session.session import Session
from duplex.settings import SessionDefaults
from duplex.transports.binding import Closing, SessionBinding
from harness.peers import Changes

PCM_RATE = 24000
GATE_S = 10.0  # how long a held decode waits for the test at most (a decode on the loop would hang it)


class Transport(Changes):
    """Records the session's events."""

    kind = "websocket"

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []

    def send_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self.notify()

    def added(self) -> list[str]:
        return [e["item"]["id"] for e in self.events if e["type"] == "conversation.item.done"]


def pcm_b64(seconds: float) -> str:
    return base64.b64encode(bytes(int(seconds * PCM_RATE) * 2)).decode("ascii")


def audio_item(item_id: str, seconds: float) -> str:
    return json.dumps({"type": "conversation.item.create", "item": {
        "id": item_id, "type": "message", "role": "user",
        "content": [{"type": "input_audio", "audio": pcm_b64(seconds)}]}})


def text_item(item_id: str) -> str:
    return json.dumps({"type": "conversation.item.create", "item": {
        "id": item_id, "type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "after the audio"}]}})


async def _no_close(closing: Closing) -> None:
    """The binding's transport close: nothing to close here."""


@pytest.fixture
async def bound() -> Any:
    transport = Transport()
    session = Session("sess_offloop", transport, ClientPlayout(), None,  # type: ignore[arg-type]
                      SessionDefaults(), ["default"], "toy")
    binding = SessionBinding(session, SessionRegistry(1), _no_close)
    binding.admit()
    binding.start()
    yield transport, binding
    await binding.end("test over")


class HeldDecode:
    """Wraps InboundDecoder.decode: notes the thread of each call and holds it until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: list[threading.Thread] = []
        self.started = threading.Event()
        self.gate = threading.Event()
        decode = wire_audio.InboundDecoder.decode

        def held(decoder: wire_audio.InboundDecoder, b64: str) -> np.ndarray:
            self.threads.append(threading.current_thread())
            self.started.set()
            self.gate.wait(GATE_S)
            return decode(decoder, b64)

        monkeypatch.setattr(wire_audio.InboundDecoder, "decode", held)


async def test_a_long_item_decodes_off_the_loop_and_later_events_wait_for_it(
        bound: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    transport, binding = bound
    held = HeldDecode(monkeypatch)
    binding.receive(audio_item("long", 30.0))
    binding.receive(text_item("after"))
    await asyncio.to_thread(held.started.wait, GATE_S)
    # The loop runs (this test does) while the decode is held, and the next event waits for it.
    assert held.threads[0] is not threading.main_thread()
    assert transport.added() == []
    held.gate.set()
    await transport.wait_for(lambda: len(transport.added()) == 2)
    assert transport.added() == ["long", "after"]
    # (The resampler holds back its last few samples: a stream is never flushed.)
    assert 30 * 16000 - len(binding.session.history.get("long").audio) < 32


async def test_a_short_append_decodes_on_the_loop(bound: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below OFF_LOOP_MIN_S the hop to a thread would cost more than the decode."""
    _, binding = bound
    held = HeldDecode(monkeypatch)
    held.gate.set()
    await binding.handle({"type": "input_audio_buffer.append", "audio": pcm_b64(OFF_LOOP_MIN_S / 2)})
    assert held.threads == [threading.main_thread()]


async def test_a_long_append_runs_through_the_vad_in_slices(
        bound: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two slices of one append's audio the loop runs other work (here: a counter)."""
    _, binding = bound
    session: Session = binding.session
    ticks = 0
    seen: list[tuple[int, int]] = []  # (ticks, samples) at each on_audio
    on_audio = session.on_audio

    def counted(samples: np.ndarray, received_at: float | None = None) -> None:
        seen.append((ticks, len(samples)))
        on_audio(samples, received_at)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    monkeypatch.setattr(session, "on_audio", counted)
    counting = asyncio.get_running_loop().create_task(ticker())
    try:
        await binding.handle({"type": "input_audio_buffer.append", "audio": pcm_b64(4.0)})
    finally:
        counting.cancel()
    assert 4 * 16000 - sum(n for _, n in seen) < 32
    assert max(n for _, n in seen) <= VAD_SLICE
    assert all(a < b for (a, _), (b, _) in itertools.pairwise(seen)), "two slices ran back to back"


def ulaw_message(seconds: float) -> dict[str, Any]:
    audio = base64.b64encode(b"\xff" * int(seconds * 8000)).decode("ascii")
    return {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio}]}


async def test_audio_beyond_the_caps_or_the_budget_is_refused_undecoded(
        bound: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An item over the items' audio cap, and a response's input over the item audio budget, are
    refused from their length alone: nothing of them is decoded."""
    transport, binding = bound
    held = HeldDecode(monkeypatch)
    held.gate.set()
    await binding.handle({"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}}})
    cap_s = MAX_CLIENT_AUDIO_BYTES / HELD_BYTES_PER_S
    await binding.handle({"type": "conversation.item.create", "item": ulaw_message(cap_s + 1)})
    await binding.handle({"type": "response.create", "response": {
        "input": [ulaw_message(ITEM_AUDIO_BURST_S / 2), ulaw_message(ITEM_AUDIO_BURST_S / 2 + 1)]}})
    errors = [(e["error"]["code"], e["error"]["param"]) for e in transport.events if e["type"] == "error"]
    assert errors == [("item_limit_exceeded", "item.content"), ("rate_limited", "response.input")]
    assert held.threads == []


async def test_a_backlog_of_events_lets_the_loop_run_between_them(bound: Any) -> None:
    """Events already queued are handed over one per loop iteration, even those whose handler never
    awaits: a client's backlog is never one long callback."""
    transport, binding = bound
    ticks = 0
    seen: list[int] = []  # ticks at each item added
    send_event = transport.send_event

    def counted(event: dict[str, Any]) -> None:
        if event["type"] == "conversation.item.done":
            seen.append(ticks)
        send_event(event)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    transport.send_event = counted  # type: ignore[method-assign]
    counting = asyncio.get_running_loop().create_task(ticker())
    try:
        for n in range(4):
            binding.receive(text_item(f"text_{n}"))
        await transport.wait_for(lambda: len(transport.added()) == 4)
    finally:
        counting.cancel()
    assert all(a < b for a, b in itertools.pairwise(seen)), "two events ran back to back"
