"""A response that ends at an awkward moment, against a scripted pipeline on virtual time (the
helpers of test_session_scripted.py):

- cancelled while its request still waits to be submitted (the coordinator holds a request of a
  conversation in ``ConversationKeeping.prepare`` until the piece of the turn in flight is done):
  the abort ends the id first, and the submission is then refused;
- ended (cancelled, cleared, failed) while speech over it holds its audio (a pending
  interruption): the agent's audio must not stay held, or the next answer is queued silent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import numpy as np
import pytest

from duplex.media.marked_playout import MarkedPlayout
from duplex.media.playout import ClientPlayout
from duplex.session.states import PendingInterruption
from harness.scripted_pipeline import ScriptedPipeline
from harness.speech import speech
from pipeline.proto import OmniRequest, OutputChunk
from tests.duplex.test_session_scripted import RATE, STEP, Host, ask, tone


class HeldPipeline(ScriptedPipeline):
    """A scripted pipeline (a fake) whose requests wait before they are submitted until ``gate``
    opens, as the coordinator's wait in ``ConversationKeeping.prepare`` for the conversation's
    piece in flight; a request aborted meanwhile is refused as the coordinator refuses it (its id
    was ended by the abort). ``held``: the requests that came to the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.held: list[OmniRequest] = []

    async def stream(self, request: OmniRequest) -> AsyncIterator[OutputChunk]:
        self.held.append(request)
        await self.gate.wait()
        if request.request_id in self.aborted:
            raise ValueError(f"request id {request.request_id!r} was already used")
        async for chunk in super().stream(request):
            yield chunk


async def _held_turn(host: Host, pipeline: HeldPipeline) -> OmniRequest:
    """A turn whose answer's request waits at the gate."""
    await host.feed(speech("What is the capital of France?", 16000, 0.3, 0.0))
    await host.silence(30)
    await host.until(lambda: bool(pipeline.held) and "response.created" in host.types())
    return pipeline.held[0]


@pytest.mark.parametrize("how", ["response.cancel", "barge-in onset"])
async def test_a_response_cancelled_before_its_request_was_submitted_ends_and_the_next_turn_is_answered(
        how: str) -> None:
    pipeline = HeldPipeline()
    host = Host(pipeline, keep_model_state=True)
    if how == "barge-in onset":  # the WebSocket: the client plays the audio, onset cancels at once
        host.session.audio = ClientPlayout()
        host.session.audio.listener = host.session
    request = await _held_turn(host, pipeline)
    if how == "response.cancel":
        host.binding.receive(json.dumps({"type": "response.cancel"}))
        await host.until(lambda: request.request_id in pipeline.aborted)
        pipeline.gate.set()
        await host.until(lambda: "response.done" in host.types())
        await ask(host, pipeline, "And of Spain?")
    else:
        word = speech("And of Spain?", 16000, 0.3, 0.0)
        await host.feed(word[: len(word) // 2])
        await host.until(lambda: request.request_id in pipeline.aborted)
        pipeline.gate.set()
        await host.feed(word[len(word) // 2 :])
        await host.silence(30)
        await host.until(lambda: len(pipeline.requests) == 1)
    assert host.of("response.done")[0]["response"]["status"] == "cancelled"
    assert [e["error"]["code"] for e in host.of("error")] == []
    # The next turn was answered: a response of its own, its request submitted.
    assert len(host.of("response.created")) == 2
    assert host.session.response is not None and host.session.response.request_id == pipeline.requests[0].request_id
    conversation = request.params["conversation_id"]
    pipeline.end()
    await host.binding.end("test over")
    assert conversation in pipeline.closed_conversations


async def test_a_session_closing_while_its_request_waits_to_be_submitted_frees_its_kept_state() -> None:
    pipeline = HeldPipeline()
    host = Host(pipeline, keep_model_state=True)
    request = await _held_turn(host, pipeline)
    ending = asyncio.get_running_loop().create_task(host.binding.end("caller hung up"))
    await host.until(lambda: request.request_id in pipeline.aborted)
    pipeline.gate.set()
    async with asyncio.timeout(10):
        await ending
    assert host.session.response is None
    assert pipeline.closed_conversations == [request.params["conversation_id"]]


class MarkedClient:
    """A Twilio-like client of a :class:`MarkedPlayout` (a fake): it plays what it receives in real
    time on the host's clock, echoes each mark when its playback reaches it, and drops what it has
    not played on ``clear``. ``media``: the samples received per item (named by its marks)."""

    def __init__(self, host: Host) -> None:
        self.playout = MarkedPlayout(8000, self._media, self._mark, self._clear)
        self._host = host
        self._queue: list[tuple[str, int]] = []  # (mark, samples before it) not yet played
        self._queued = 0  # samples received and not yet played
        self._at = host.clock  # the clock of the last tick
        self.media: dict[str, int] = {}
        self._last: int = 0

    def _media(self, samples: np.ndarray) -> None:
        self._queued += len(samples)
        self._last = len(samples)

    def _mark(self, name: str) -> None:
        item = name.rpartition(":")[0]
        self.media[item] = self.media.get(item, 0) + self._last
        self._last = 0
        self._queue.append((name, self._queued))

    def _clear(self) -> None:
        self._queue.clear()
        self._queued = 0

    def tick(self) -> None:
        """Play what the clock advanced by, echoing the marks reached."""
        played = int((self._host.clock - self._at) * 8000)
        self._at = self._host.clock
        self._queued = max(0, self._queued - played)
        self._queue = [(name, before - played) for name, before in self._queue]
        while self._queue and self._queue[0][1] <= 0:
            self.playout.on_mark(self._queue.pop(0)[0])


def _marked(host: Host) -> MarkedClient:
    client = MarkedClient(host)
    host.session.audio = client.playout
    client.playout.listener = host.session
    real_step = host.step

    async def step(mic: np.ndarray) -> None:
        await real_step(mic)
        client.tick()

    host.step = step  # type: ignore[method-assign]
    return client


def _playing(host: Host, client: MarkedClient | None, item_id: str) -> bool:
    if client is not None:
        return client.media.get(item_id, 0) > 0
    return host.track.sent_ms(item_id) > 0


@pytest.mark.parametrize("playout", ["paced", "marked"])
@pytest.mark.parametrize("ending", ["response.cancel", "output_audio_buffer.clear", "stage failure"])
async def test_a_response_ending_while_speech_holds_its_audio_leaves_the_next_answer_audible(
        ending: str, playout: str) -> None:
    pipeline = ScriptedPipeline()
    host = Host(pipeline)
    client = _marked(host) if playout == "marked" else None
    await ask(host, pipeline)
    pipeline.push(text="Paris is the capital. ", audio=tone(3.0), sample_rate=RATE)
    await host.until(lambda: host.session.audio.queued_seconds() >= 2.9)
    await host.silence(75)  # 1.5 s of the answer played, past the echo guard
    word = speech("Wait, and what about Spain?", 16000, 0.0, 0.0)
    onset = int(np.nonzero(np.abs(word) > 0.01)[0][0]) // STEP * STEP
    await host.feed(word[: onset + 5 * STEP])  # 100 ms of speech: the audio is held, nothing confirmed
    assert isinstance(host.session.barge_in, PendingInterruption)
    interrupted = host.session.response.item.id
    if ending == "stage failure":
        pipeline.fail("stage crashed: boom")
    else:
        host.binding.receive(json.dumps({"type": ending}))
    await host.until(lambda: "response.done" in host.types())
    # What the speech held of the ended answer is dropped, not played later.
    if client is None:
        assert host.track.queued_seconds == 0
    sent = client.media.get(interrupted, 0) if client is not None else 0
    # The user goes on: their turn ends and is answered; that answer is heard.
    await host.feed(word[onset + 5 * STEP :])
    await host.silence(30)
    await host.until(lambda: len(host.of("response.created")) == 2)
    item = host.session.response.item.id
    pipeline.push(text="Madrid.", audio=tone(0.5), sample_rate=RATE)
    pipeline.end()
    for _ in range(25):  # half a second: the answer is the only audio left to play
        await host.silence(1)
        if _playing(host, client, item):
            break
    assert _playing(host, client, item), "the next answer is not played"
    if client is not None:
        assert client.media.get(interrupted, 0) == sent, "the ended answer's held audio was sent again"
    assert host.session.barge_in is None
    await host.binding.end("test over")
