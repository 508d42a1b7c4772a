"""The model's kept state of one session's conversation (``keep_model_state``): which pipeline
conversation a request continues, and freeing it when the session's history stops matching it.

The kept state covers the previous request's messages (and the tools it offered, which the model's
prompt carries) plus its answer; a request continues it only if it offers the same tools and its
messages begin with those (anything else — an edit, a deletion, new instructions or tools, old
audio leaving the budget, an answer that never came — starts a new conversation and frees the old). A
request withdrawn (a speculative answer the user talked over: ``ModelPipeline.withdraw``, which
undoes its turn in the pipeline even where it had ended) leaves the pipeline's state as it was
before it: ``withdraw`` says so here too. A KeptModelState belongs to one session;
``close`` frees what the pipeline keeps for it.

The kept answer is the one thing a request does not compare (it is the next request's message at
the kept state's end): a truncation of it (``conversation.item.truncate`` from a client that plays
the audio itself, after the response is done) must cut the kept state the same way. ``cut`` says
which request's answer to cut, where the history's text is that of its first N answer tokens and
nothing of the conversation is in flight; anywhere else the kept state cannot follow the history,
and the conversation is dropped (now, or by the next request where a request may be in flight),
so that the next turn is a full prefill rather than a continuation of a stale state. Where no
stage keeps state, only caches (``ModelPipeline.keeps_conversations`` false: the offline preset's
LM, which reuses the longest prefix of its prompt that its cache holds, whatever the history
says), a cut that is not token-exact drops nothing: the next request's prompt re-derives it.

Prefill while the user speaks (:mod:`duplex.session.prefill`): a partial request (``until`` > 0
seconds) leaves the state inside the user's turn ("open"): it covers the messages before the turn
and the turn's first ``until`` seconds of audio. A later request continues the open turn where its
turn's audio begins with the same samples (the next piece, or the answer), and says so
(``conversation_open_s``); any other request abandons it, and the pipeline undoes the open turn
before that request continues what came before it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np

from duplex.protocol.events import new_id
from duplex.session.model_pipeline import ModelPipeline
from duplex.turns.vad import SAMPLE_RATE
from pipeline.scheduling.conversation_book import OPEN_PARAM, SESSION_PARAM

Open = tuple[np.ndarray, int]
"""An open turn: its audio as the last partial request sent it, and the seconds of it kept."""


class KeptModelState:
    def __init__(self, pipeline: ModelPipeline, enabled: bool) -> None:
        self._pipeline = pipeline
        self._enabled = enabled
        self._conversation: str | None = None
        self._keys: list[tuple[Any, ...]] = []  # (role, text, audio, images) of the last request
        self._open: Open | None = None  # the last request was partial: the turn it left open
        self._before: tuple[list[tuple[Any, ...]], Open | None] = ([], None)  # before the last request
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
                         request_id: str | None = None, until: int = 0) -> dict[str, Any]:
        """The params naming the kept conversation for the request ``request_id`` with
        ``messages`` offering ``tools`` (none when state is not kept); ``until``: the request is
        partial, its last message the turn so far, of which it prefills ``until`` seconds."""
        if not self._enabled:
            return {}
        offered = ("tools", json.dumps(tools, sort_keys=True) if tools else None)
        keys = [offered, *((m["role"], m["text"], None if m["audio"] is None else id(m["audio"]),
                            tuple(map(id, m.get("images") or ()))) for m in messages)]
        previous, held = self._keys, self._open
        self._before = (previous, held)
        self._keys, self._open = (keys[:-1], (messages[-1]["audio"], until)) if until else (keys, None)
        self._request, self._answer = request_id, None
        extends = bool(previous) and keys[: len(previous)] == previous and len(keys) > len(previous)
        if held is None:
            # The state covers the previous request's messages and its answer, which comes next.
            continues = extends and keys[len(previous)][0] == "assistant"
        else:
            continues = extends  # the open turn is continued, or abandoned and undone
        continues = continues and self._conversation is not None and not self._stale
        if not continues:
            # Kept state this request does not continue is freed; where nothing is kept (the
            # conversation's first request was withdrawn) the conversation id serves again.
            if previous or self._stale:
                self._forget()
            self._before = ([], None)
            if self._conversation is None:
                self._conversation = new_id("conv")
        params: dict[str, Any] = {SESSION_PARAM: self._conversation}
        if continues and held is not None and _same_turn(messages[len(previous) - 1], held, until):
            params[OPEN_PARAM] = held[1]
        return params

    def withdraw(self, request_id: str) -> None:
        """``request_id`` was withdrawn (``ModelPipeline.withdraw``) and keeps nothing. Where it
        is the last request, the state is what it was before it (or nothing, where that request began a new conversation); where a
        newer request was built since, that one's baseline stands (it was set against the
        withdrawn one, and freed or continued what the pipeline keeps accordingly)."""
        if request_id != self._request:
            return
        self._keys, self._open = self._before
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
        if answer_tokens is None and not self._pipeline.keeps_conversations:
            return None  # the pipeline's cache follows the history's text by itself
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


def _same_turn(message: dict[str, Any], held: Open, until: int) -> bool:
    """Whether ``message`` is the open turn ``held`` went on: a user turn of audio whose first
    seconds are the ones kept (and, for a next piece, one that goes further)."""
    audio, seconds = held
    n = seconds * SAMPLE_RATE
    got = message.get("audio")
    return (message["role"] == "user" and got is not None and not message.get("text")
            and len(got) >= n and (not until or until > seconds)
            and np.array_equal(got[:n], audio[:n]))
