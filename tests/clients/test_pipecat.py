"""pipecat's ``OpenAIRealtimeLLMService``, unchanged and with its defaults, against a real server
(toy preset): two spoken turns answered with audio, a barge-in, a tool call round trip, and no
error (pipecat treats any ``error`` event as fatal to its connection).

No transport: a pipeline of the test's microphone (``InputAudioRawFrame``s queued in real time,
speech and silence between), the service and a sink that keeps the frames that come out of it.
The tool call runs as pipecat's function calling does: a function registered with the service,
offered through the context's tools, and the context aggregators that send its result back and
ask for the answer.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import numpy as np
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.frames import frames
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineParams, PipelineTask
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.llm_service import FunctionCallParams
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

from harness.server import ServerProcess
from harness.speech import speech
from tests.api.helpers import API_KEY, answer_samples, metric

RATE = 24000
FRAME = RATE // 10  # 100 ms
TIMEOUT = 30.0


class Sink(FrameProcessor):
    """Keeps what comes out of the service: answers' audio, response ends, errors."""

    def __init__(self) -> None:
        super().__init__()
        self.audio: list[bytes] = []
        self.responses_ended = 0
        self.errors: list[Any] = []

    async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, frames.TTSAudioRawFrame):
            self.audio.append(frame.audio)
        elif isinstance(frame, frames.LLMFullResponseEndFrame):
            self.responses_ended += 1
        elif isinstance(frame, frames.ErrorFrame):
            self.errors.append(frame)
        await self.push_frame(frame, direction)

    def seconds(self) -> float:
        return sum(len(a) for a in self.audio) / 2 / RATE


class Microphone:
    """100 ms ``InputAudioRawFrame``s in real time: queued speech, else silence."""

    def __init__(self, task: PipelineTask) -> None:
        self._task = task
        self._pending = np.zeros(0, np.float32)

    def say(self, samples: np.ndarray) -> None:
        self._pending = np.concatenate([self._pending, samples])

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for n in itertools.count():
            piece, self._pending = self._pending[:FRAME], self._pending[FRAME:]
            piece = np.concatenate([piece, np.zeros(FRAME - len(piece), np.float32)])
            pcm = np.clip(piece * 32768, -32768, 32767).astype(np.int16).tobytes()
            await self._task.queue_frame(frames.InputAudioRawFrame(audio=pcm, sample_rate=RATE, num_channels=1))
            await asyncio.sleep(max(0.0, start + (n + 1) * FRAME / RATE - loop.time()))


async def until(condition: Any, what: str, sink: Sink) -> None:
    try:
        async with asyncio.timeout(TIMEOUT):
            while not condition():
                assert not sink.errors, sink.errors
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_pipecat_converses_and_is_interrupted(server: ServerProcess) -> None:
    url = server.url.replace("http", "ws") + "/v1/realtime"
    llm = OpenAIRealtimeLLMService(api_key=API_KEY, base_url=url)
    statuses: dict[str, str] = {}  # the answers' items as response.done left them
    answers: dict[str, Any] = {}  # the same items

    @llm.event_handler("on_conversation_item_updated")
    async def _updated(service: Any, item_id: str, item: Any) -> None:
        if item is not None and getattr(item, "role", None) == "assistant":
            statuses[item_id] = item.status
            answers[item_id] = item

    barge_ins = metric(server, "duplex_barge_ins_total")

    sink = Sink()
    task = PipelineTask(Pipeline([llm, sink]), params=PipelineParams(audio_in_sample_rate=RATE,
                                                                      audio_out_sample_rate=RATE))
    runner = asyncio.get_running_loop().create_task(PipelineRunner(handle_sigint=False).run(task))
    mic = Microphone(task)
    mic_task = asyncio.get_running_loop().create_task(mic.run())
    try:
        for n, question in enumerate(["What is the weather like today?", "And what about tomorrow?"], 1):
            before = sink.seconds()
            mic.say(speech(question, RATE, 0.3, 0.0))
            await until(lambda n=n: sink.responses_ended >= n and len(answers) >= n, f"answer {n}", sink)
            # This turn's answer, all of its audio: what came since the question, not since the call.
            answer = list(answers.values())[n - 1]
            heard = round((sink.seconds() - before) * RATE)
            assert heard == answer_samples(answer.content[0].transcript) > RATE, (n, heard, answer)
        # A barge-in: speech over the next answer; it ends early, and the speech is answered.
        mic.say(speech("Tell me a long story about the sea.", RATE, 0.3, 0.0))
        before = sink.seconds()
        await until(lambda: sink.seconds() - before >= 1.2, "the third answer's audio", sink)
        mic.say(speech("Stop, stop, I have another question.", RATE, 0.0, 0.0))
        await until(lambda: sink.responses_ended >= 4, "the interruption's answer", sink)
        await until(lambda: len(statuses) >= 4, "the answers' items", sink)
        assert list(statuses.values())[:4] == ["completed", "completed", "incomplete", "completed"]
        assert metric(server, "duplex_barge_ins_total") == barge_ins + 1
    finally:
        mic_task.cancel()
        await task.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    assert not sink.errors, sink.errors


async def test_pipecat_tool_call_round_trip(server: ServerProcess) -> None:
    """The toy calls the offered tool for the user's question; pipecat runs the registered function
    with the server's arguments, sends its result and asks for a response, which is spoken."""
    url = server.url.replace("http", "ws") + "/v1/realtime"
    llm = OpenAIRealtimeLLMService(api_key=API_KEY, base_url=url)
    items: dict[str, Any] = {}  # every item as conversation.item.done or response.done left it
    calls: list[tuple[str, dict[str, Any], float]] = []  # (call id, arguments, audio heard before)

    @llm.event_handler("on_conversation_item_updated")
    async def _updated(service: Any, item_id: str, item: Any) -> None:
        if item is not None:
            items[item_id] = item

    sink = Sink()

    async def get_forecast(params: FunctionCallParams) -> None:
        calls.append((params.tool_call_id, dict(params.arguments), sink.seconds()))
        await params.result_callback({"forecast": "sunny"})

    llm.register_function("get_forecast", get_forecast)
    forecast = FunctionSchema(name="get_forecast", description="The weather forecast.",
                              properties={"words": {"type": "string"}}, required=["words"])
    context = LLMContext([{"role": "user", "content": "What will the weather be tomorrow?"}],
                         ToolsSchema(standard_tools=[forecast]))
    user_aggregator, assistant_aggregator = LLMContextAggregatorPair(context)
    params = PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE)
    task = PipelineTask(Pipeline([user_aggregator, llm, sink, assistant_aggregator]), params=params)
    runner = asyncio.get_running_loop().create_task(PipelineRunner(handle_sigint=False).run(task))
    try:
        await task.queue_frame(frames.LLMRunFrame())
        await until(lambda: sink.responses_ended >= 2, "the answer to the function's result", sink)
        await until(lambda: any(getattr(i, "role", None) == "assistant" for i in items.values()),
                    "the answer's item", sink)
    finally:
        await task.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    assert not sink.errors, sink.errors

    # The function ran once, with the call the server made (the toy's arguments: its words).
    server_calls = [i for i in items.values() if i.type == "function_call"]
    assert len(server_calls) == 1 and server_calls[0].name == "get_forecast", items
    assert [(call_id, args) for call_id, args, _ in calls] == \
        [(server_calls[0].call_id, json.loads(server_calls[0].arguments))]
    # The call was silent; the server answered its result after it, in a complete spoken answer
    # whose audio pipecat received in full.
    assert calls[0][2] == 0.0
    assert [i.type for i in items.values()] == \
        ["message", "function_call", "function_call_output", "message"]
    answer = list(items.values())[-1]
    assert (answer.role, answer.status) == ("assistant", "completed"), answer
    assert round(sink.seconds() * RATE) == answer_samples(answer.content[0].transcript) > 0
    # pipecat's context holds the call's result, as it does with any LLM.
    results = [m for m in context.get_messages() if m.get("role") == "tool"]
    assert [m["tool_call_id"] for m in results] == [server_calls[0].call_id]
