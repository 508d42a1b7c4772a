"""A scripted ModelPipeline: a fake of the model pipeline, named as such, for session tests that must
decide exactly when each chunk of a response arrives (the real pipelines answer when they answer).

It records every request and abort; the test pushes each request's chunks (``push`` / ``end`` /
``fail``, to the newest request unless ``request_id`` says which). Lives as long as its test.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from pipeline.coordinator import PipelineError
from pipeline.proto import OmniRequest, OutputChunk

RATE = 24000


class ScriptedPipeline:
    """A fake ModelPipeline: each request's chunks are pushed by the test (``push``/``end``/``fail``)."""

    ready = True
    output_sample_rate = RATE
    input_modalities = ("text", "audio")
    keeps_conversations = True  # as a thinker's kept state: cuts must be token-exact

    def __init__(self) -> None:
        self.requests: list[OmniRequest] = []
        self.aborted: list[str] = []
        self.kept_on_abort: list[int | None] = []
        self.withdrawn: list[str] = []  # requests aborted by ``withdraw`` (also in ``aborted``)
        self.closed_conversations: list[str] = []
        self._queues: dict[str, asyncio.Queue[OutputChunk | Exception | None]] = {}
        self.started = asyncio.Event()

    async def stream(self, request: OmniRequest) -> AsyncIterator[OutputChunk]:
        queue: asyncio.Queue[OutputChunk | Exception | None] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self.requests.append(request)
        self.started.set()
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    async def abort(self, request_id: str, keep_answer_tokens: int | None = None) -> None:
        self.aborted.append(request_id)
        self.kept_on_abort.append(keep_answer_tokens)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(None)

    async def withdraw(self, request_id: str) -> None:
        self.withdrawn.append(request_id)
        await self.abort(request_id)

    async def close_conversation(self, conversation_id: str) -> None:
        self.closed_conversations.append(conversation_id)

    def push(self, request_id: str | None = None, **data: Any) -> None:
        rid = request_id or self.requests[-1].request_id
        self._queues[rid].put_nowait(OutputChunk(rid, "scripted", data))

    def end(self, request_id: str | None = None) -> None:
        self._queues[request_id or self.requests[-1].request_id].put_nowait(None)

    def fail(self, message: str) -> None:
        self._queues[self.requests[-1].request_id].put_nowait(PipelineError("talker", message))
