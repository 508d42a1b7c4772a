"""The model's kept state of one session's conversation (``keep_model_state``): which pipeline
conversation a request continues, and freeing it when the session's history stops matching it.

The kept state covers the previous request's messages (and the tools it offered, which the model's
prompt carries) plus its answer; a request continues it only if it offers the same tools and its
messages begin with those (anything else — an edit, a deletion, new instructions or tools, old
audio leaving the budget, an answer that never came — starts a new conversation and frees the old). A
request aborted before it kept anything (a speculative answer the user talked over) leaves the
pipeline's state as it was: ``withdraw`` says so here too. A KeptModelState belongs to one session;
``close`` frees what the pipeline keeps for it.

The kept answer is the one thing a request does not compare (it is the next request's message at
the kept state's end): a truncation of it (``conversation.item.truncate`` from a client that plays
the audio itself, after the response is done) must cut the kept state the same way. ``cut`` says
which request's answer to cut, where the history's text is that of its first N answer tokens and
nothing of the conversation is in flight; anywhere else the kept state cannot follow the history,
and the conversation is dropped (now, or by the next request where a request may be in flight),
so that the next turn is a full prefill rather than a continuation of a stale state.
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
        self._request: str | None = None  # the last request (its messages are ``_keys``)
        # The history item of the last request's answer, once its response is over and while no
        # other request began: a cut of that request then reaches the kept state (see ``cut``).
        self._answer: str | None = None
        self._stale = False  # the kept answer is no longer the history's: the next request starts anew
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self._enabled

    def conversation_for(self, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None = None,
                         request_id: str | None = None) -> str | None:
        """The conversation id for the request ``request_id`` with ``messages`` offering ``tools``
        (None when state is not kept)."""
        if not self._enabled:
            return None
        offered = ("tools", json.dumps(tools, sort_keys=True) if tools else None)
        keys = [offered, *((m["role"], m["text"], None if m["audio"] is None else id(m["audio"]))
                           for m in messages)]
        previous, self._keys = self._keys, keys
        self._before = previous
        self._request, self._answer = request_id, None
        continues = (self._conversation is not None and bool(previous) and not self._stale
                     and keys[: len(previous)] == previous
                     and len(keys) > len(previous) and keys[len(previous)][0] == "assistant")
        if not continues:
            # Kept state this request does not continue is freed; where nothing is kept (the
            # conversation's first request was withdrawn) the conversation id serves again.
            if previous or self._stale:
                self._forget()
            self._before = []
            if self._conversation is None:
                self._conversation = new_id("conv")
        return self._conversation

    def withdraw(self) -> None:
        """The last request was aborted and kept nothing: the state is what it was before it (or
        nothing, where that request began a new conversation)."""
        self._keys = self._before
        # Its abort may still be on its way, and the answer the state ends with is not known here.
        self._request = self._answer = None

    def answered(self, request_id: str, item_id: str) -> None:
        """The response to ``request_id`` is over (done, cancelled or failed), and its answer is
        the history item ``item_id`` alone (the session does not call this for an answer that
        also made a function call: a cut of its words would cut the call out of the kept state)."""
        if request_id == self._request:
            self._answer = item_id

    def cut(self, item_id: str, answer_tokens: int | None) -> str | None:
        """The history's text of the assistant item ``item_id`` was truncated to the text of its
        first ``answer_tokens`` answer tokens (None: not token-exact). Returns the request whose
        answer the kept state must be cut to as many (``ModelPipeline.abort(request,
        keep_answer_tokens=answer_tokens)``, which cuts an ended request's kept turn) where the
        item is the last request's answer, its response is over and no request began since. (If
        that request left no kept turn — cancelled back to before it, failed — the pipeline cuts
        nothing, and the item's text is new to the kept state, as the history has it.) Otherwise
        the conversation is dropped, and None returned: now where nothing of it is in flight, else
        by the next request."""
        if self._conversation is None:
            return None
        settled = self._answer is not None
        if settled and not self._stale and self._answer == item_id and answer_tokens is not None:
            return self._request
        if settled:
            self._forget()
        else:
            self._stale = True
        return None

    def _forget(self) -> None:
        conversation, self._conversation = self._conversation, None
        self._answer, self._stale = None, False
        if conversation is not None:
            task = asyncio.get_running_loop().create_task(self._pipeline.close_conversation(conversation))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Free what the pipeline keeps (the session ended); returns once it is freed."""
        self._forget()
        await asyncio.gather(*self._closing, return_exceptions=True)
