"""LiveKit Agents' OpenAI Realtime plugin, unchanged and with its defaults (semantic_vad, voice
"marin", input transcription, ``max_output_tokens: "inf"``), against a real server (toy preset):
two spoken turns answered, ``generate_reply()`` answered, a barge-in, a tool call round trip, and
no error event.

No LiveKit room: ``RealtimeModel.session()`` opens its own connection; the test's microphone pushes
``rtc.AudioFrame``s in real time (speech, silence between) and reads the answers from the
generations the plugin emits. Tools run only inside an ``AgentSession`` (it executes an Agent's
``@function_tool``s, sends their results and asks for the answer), so the tool call runs in one,
started without a room, its audio output a speaker of the test's own.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from livekit import rtc
from livekit.agents import Agent, AgentSession, function_tool
from livekit.agents.voice import io
from livekit.plugins.openai import realtime

from harness.server import ServerProcess
from harness.speech import speech
from tests.api.helpers import API_KEY, answer_samples

RATE = 24000
TIMEOUT = 30.0
FRAME = RATE // 10  # 100 ms frames


class LiveKitPeer:
    """One plugin session, the raw server events it received, and the audio of each generation."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.events: list[dict[str, Any]] = []
        self.errors: list[Any] = []
        self.generations: list[Any] = []
        self.audio: dict[str, list[np.ndarray]] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}  # response id -> its audio's reader
        self._pending = np.zeros(0, np.float32)
        self.mic = asyncio.get_running_loop().create_task(self._microphone())
        session.on("openai_server_event_received", self.events.append)
        session.on("error", self.errors.append)
        session.on("generation_created", self._on_generation)

    def _on_generation(self, generation: Any) -> None:
        self.generations.append(generation)
        self._readers[generation.response_id] = asyncio.get_running_loop().create_task(self._read(generation))

    async def _read(self, generation: Any) -> None:
        chunks = self.audio.setdefault(generation.response_id, [])
        async for message in generation.message_stream:
            async for frame in message.audio_stream:
                chunks.append(np.frombuffer(frame.data, dtype=np.int16).astype(np.float32) / 32768)

    def push(self, samples: np.ndarray) -> None:
        """Queue speech for the microphone (which sends silence when it has none)."""
        self._pending = np.concatenate([self._pending, samples])

    async def _microphone(self) -> None:
        """100 ms frames in real time, as a live microphone sends them: the turn detector's
        pauses take real time, as with any client."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        for n in itertools.count():
            piece, self._pending = self._pending[:FRAME], self._pending[FRAME:]
            piece = np.concatenate([piece, np.zeros(FRAME - len(piece), np.float32)])
            pcm = np.clip(piece * 32768, -32768, 32767).astype(np.int16)
            self.session.push_audio(rtc.AudioFrame(pcm.tobytes(), RATE, 1, FRAME))
            await asyncio.sleep(max(0.0, start + (n + 1) * FRAME / RATE - loop.time()))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    async def until(self, kind: str, count: int = 1) -> dict[str, Any]:
        """The ``count``-th server event of ``kind``."""
        try:
            async with asyncio.timeout(TIMEOUT):
                while len(self.of(kind)) < count:
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"no {kind} #{count}: {[e['type'] for e in self.events]}") from None
        return self.of(kind)[count - 1]

    async def audio_of(self, response_id: str) -> float:
        """The seconds of a generation's audio, once the plugin has closed its audio stream."""
        try:
            async with asyncio.timeout(TIMEOUT):
                while response_id not in self._readers:
                    await asyncio.sleep(0.02)
                await self._readers[response_id]
        except TimeoutError:
            raise AssertionError(f"the audio stream of {response_id} did not end") from None
        return self.seconds(response_id)

    def seconds(self, response_id: str) -> float:
        return sum(len(c) for c in self.audio.get(response_id, [])) / RATE


@asynccontextmanager
async def livekit(server: ServerProcess) -> AsyncIterator[LiveKitPeer]:
    model = realtime.RealtimeModel(base_url=f"{server.url}/v1", api_key=API_KEY)
    session = model.session()
    peer = LiveKitPeer(session)
    try:
        yield peer
    finally:
        peer.mic.cancel()
        await session.aclose()
        await model.aclose()


async def test_livekit_agents_converses_with_its_defaults(server: ServerProcess) -> None:
    async with livekit(server) as peer:
        updated = await peer.until("session.updated")
        # Its first session.update is taken whole: OpenAI names and all.
        assert updated["session"]["audio"]["output"]["voice"] == "marin"
        assert updated["session"]["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
        await peer.session.update_instructions("You are a test agent.")
        assert (await peer.until("session.updated", 2))["session"]["instructions"] == "You are a test agent."

        # Two spoken turns, each answered with audio the plugin decoded.
        for n, question in enumerate(["What is the weather like today?", "And what about tomorrow?"], 1):
            peer.push(speech(question, RATE, 0.3, 0.0))
            done = await peer.until("response.done", n)
            assert done["response"]["status"] == "completed"
            # All of this answer's audio, as the plugin decoded it once its audio channel closed.
            heard = round(await peer.audio_of(done["response"]["id"]) * RATE)
            transcript = done["response"]["output"][0]["content"][0]["transcript"]
            assert heard == answer_samples(transcript) > RATE, (n, heard, transcript)

        # generate_reply(): answered (the future resolves on the response it asked for).
        generation = await asyncio.wait_for(peer.session.generate_reply(instructions="Say hello."), TIMEOUT)
        assert generation.user_initiated
        done = await peer.until("response.done", 3)
        assert done["response"]["id"] == generation.response_id
        assert done["response"]["status"] == "completed"

        # A barge-in: speech over the answer cancels it.
        peer.push(speech("Tell me a long story about the sea.", RATE, 0.3, 0.0))
        created = await peer.until("response.created", 4)
        async with asyncio.timeout(TIMEOUT):
            while peer.seconds(created["response"]["id"]) < 1.2:
                await asyncio.sleep(0.02)
        peer.push(speech("Stop, stop, I have another question.", RATE, 0.0, 0.0))
        cancelled = await peer.until("response.done", 4)
        assert cancelled["response"]["id"] == created["response"]["id"]
        assert cancelled["response"]["status"] == "cancelled"
        await peer.until("response.done", 5)  # the interruption is answered in turn
    assert not peer.of("error"), peer.of("error")
    assert not peer.errors


class Speaker(io.AudioOutput):
    """The agent session's audio output: keeps every frame, and plays each segment out as soon as
    it is flushed (the session waits for playout before it takes the answer as spoken)."""

    def __init__(self) -> None:
        super().__init__(label="test speaker", capabilities=io.AudioOutputCapabilities(pause=False))
        self.frames: list[rtc.AudioFrame] = []
        self._segment_s = 0.0

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if not self._segment_s:
            self.on_playback_started(created_at=time.time())
        self.frames.append(frame)
        self._segment_s += frame.duration

    def flush(self) -> None:
        super().flush()
        self._end_segment(interrupted=False)

    def clear_buffer(self) -> None:
        self._end_segment(interrupted=True)

    def _end_segment(self, interrupted: bool) -> None:
        if self._segment_s:
            self.on_playback_finished(playback_position=self._segment_s, interrupted=interrupted)
            self._segment_s = 0.0

    def samples(self) -> int:
        return sum(f.samples_per_channel for f in self.frames)


class ForecastAgent(Agent):
    """An agent with one tool, which records the arguments of each call."""

    def __init__(self) -> None:
        super().__init__(instructions="You are a test agent.")
        self.calls: list[str] = []

    @function_tool
    async def get_forecast(self, words: str) -> str:
        """The weather forecast.

        Args:
            words: What to forecast.
        """
        self.calls.append(words)
        return "sunny"


@dataclass
class ForecastRun:
    """An AgentSession's run of one user question with :class:`ForecastAgent`: its result, the
    agent, its speaker, the server events its realtime session received, the session's errors."""

    result: Any
    agent: ForecastAgent
    speaker: Speaker
    events: list[dict[str, Any]]
    errors: list[Any]


async def forecast_run(model: realtime.RealtimeModel) -> ForecastRun:
    """Ask ``model``'s AgentSession about tomorrow's weather, then close the session and model."""
    agent, speaker = ForecastAgent(), Speaker()
    session = AgentSession(llm=model)
    session.output.audio = speaker
    errors: list[Any] = []
    session.on("error", errors.append)
    events: list[dict[str, Any]] = []
    try:
        await session.start(agent)
        # The agent's realtime session exists once it runs; it is still connecting then.
        agent.realtime_llm_session.on("openai_server_event_received", events.append)
        async with asyncio.timeout(TIMEOUT):
            result = await session.run(user_input="What will the weather be tomorrow?")
    finally:
        await session.aclose()
        await model.aclose()
    return ForecastRun(result, agent, speaker, events, errors)


async def test_livekit_agents_tool_call_round_trip(server: ServerProcess) -> None:
    """The toy calls the agent's tool for the user's question; the session runs it with the
    server's arguments, sends its result and asks for the answer, which the speaker plays."""
    run = await forecast_run(realtime.RealtimeModel(base_url=f"{server.url}/v1", api_key=API_KEY))
    result, agent, speaker, events, errors = run.result, run.agent, run.speaker, run.events, run.errors
    assert not [e for e in events if e["type"] == "error"], events
    assert not errors, errors

    # The server made one call; the session ran the agent's tool once with its arguments, sent the
    # tool's output, and the answer followed.
    done = [e["response"] for e in events if e["type"] == "response.done"]
    assert [r["status"] for r in done] == ["completed", "completed"], done
    call = done[0]["output"][0]
    assert call["type"] == "function_call" and call["name"] == "get_forecast", call
    arguments = json.loads(call["arguments"])
    assert agent.calls == [arguments["words"]]
    result.expect.next_event().is_function_call(name="get_forecast", arguments=arguments)
    result.expect.next_event().is_function_call_output(output="sunny")
    result.expect.next_event().is_message(role="assistant")
    result.expect.no_more_events()
    # The answer came after the function's output, spoken: the speaker played all of its audio.
    kinds = [(e["type"], e.get("item", {}).get("type")) for e in events]
    call_done = kinds.index(("response.done", None))
    answer_created = kinds.index(("response.created", None), call_done)
    output_added = kinds.index(("conversation.item.added", "function_call_output"))
    assert call_done < output_added < answer_created
    answer = done[1]["output"][0]
    assert answer["type"] == "message" and answer["status"] == "completed", answer
    assert speaker.samples() == answer_samples(answer["content"][0]["transcript"]) > 0
