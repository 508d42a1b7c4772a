"""The model's kept state of one session's conversation (``keep_model_state``): which pipeline
conversation a request continues, and freeing it when the session's history stops matching it.

The kept state covers the previous request's messages (and the tools it offered, which the model's
prompt carries) plus its answer; a request continues it only if it offers the same tools and its
messages begin with those (anything else — an edit, a deletion, new instructions or tools, old
audio leaving the budget, an answer that never came — starts a new conversation and frees the old). A
request aborted before it kept anything (a speculative answer the user talked over) leaves the
pipeline's state as it was: ``withdraw`` says so here too. A KeptModelState belongs to one session;
``close`` frees what the pipeline keeps for it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from duplex.protocol.events import new_id
from duplex.session.model_pipeline import ModelPipeline


class KeptModelState:
    def __init__(self, pipeline: ModelPipeline, enabled: bool) -> None:
        self._pipeline = pipeline
        self._enabled = enabled
        self._conversation: str | None = None
        self._keys: list[tuple[Any, ...]] = []  # (role, text, audio identity) of the last request
        self._before: list[tuple[Any, ...]] = []  # the keys before the last request
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self._enabled

    def conversation_for(self, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None = None) -> str | None:
        """The conversation id for a request with ``messages`` offering ``tools`` (None when state
        is not kept)."""
        if not self._enabled:
            return None
        offered = ("tools", json.dumps(tools, sort_keys=True) if tools else None)
        keys = [offered, *((m["role"], m["text"], None if m["audio"] is None else id(m["audio"]))
                           for m in messages)]
        previous, self._keys = self._keys, keys
        self._before = previous
        continues = (self._conversation is not None and bool(previous)
                     and keys[: len(previous)] == previous
                     and len(keys) > len(previous) and keys[len(previous)][0] == "assistant")
        if not continues:
            # Kept state this request does not continue is freed; where nothing is kept (the
            # conversation's first request was withdrawn) the conversation id serves again.
            if previous:
                self._forget()
            self._before = []
            if self._conversation is None:
                self._conversation = new_id("conv")
        return self._conversation

    def withdraw(self) -> None:
        """The last request was aborted and kept nothing: the state is what it was before it (or
        nothing, where that request began a new conversation)."""
        self._keys = self._before

    def _forget(self) -> None:
        conversation, self._conversation = self._conversation, None
        if conversation is not None:
            task = asyncio.get_running_loop().create_task(self._pipeline.close_conversation(conversation))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Free what the pipeline keeps (the session ended); returns once it is freed."""
        self._forget()
        await asyncio.gather(*self._closing, return_exceptions=True)
