"""The language model's KV of a conversation, kept between its requests (a cache).

Each turn of a conversation is prompted anew with the whole history (``lm.py``), and without this
its prefill grows with every turn: on one core SmolLM2-135M prefills ~2.5-3.5 ms a token, so by
the tenth turn (~600 tokens) the first token would wait ~2 s. A ``PrefixCache`` keeps, per
conversation, the onnxruntime-genai generator its last request decoded with (its KV) and the
tokens that KV holds, and gives the conversation's next request that generator rewound to the
longest prefix of tokens the two share, compared exactly: only the tokens after it are prefilled.
The history's earlier turns, and the last answer as far as the history has it, are that prefix.

This is a cache, not conversation state: nothing depends on it being there. The prompt says what
the conversation is, and the tokens say what is reusable: an answer cut after a barge-in, a turn
the user went on with (a speculative answer withdrawn) or instructions changed only shorten the
prefix, and a missing entry costs a full prefill, never an error.

Who owns what: the ``lm`` stage's runner owns one. An entry lives from the end of the decoding
of the conversation's request that made it until the conversation's next request takes it (and
gives back its own generator when it ends), ``drop`` (the session closed, or changed what came
before), or eviction to stay within its ``Budget`` (least recently used first; an entry over the
per-conversation budget is not kept). A conversation dropped while one of its requests still
decodes keeps nothing of it either: that request's ``put`` finds it dropped. ``take`` and ``put``
run on decoding threads, ``drop`` and ``sizes`` on the scheduler's, hence the lock.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from pipeline.scheduling.cache_budget import BudgetedEntries
from pipeline.scheduling.conversation_book import Budget

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    generator: Any  # onnxruntime_genai.Generator
    tokens: list[int]
    """The tokens its KV holds, oldest first."""


def shared_prefix(held: list[int], prompt: list[int]) -> int:
    """How many leading tokens of ``prompt`` equal those of ``held``."""
    n = 0
    for a, b in zip(held, prompt):
        if a != b:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, budget: Budget, token_bytes: int, max_length: int) -> None:
        self._token_bytes = token_bytes  # KV bytes per token
        self._max_length = max_length  # tokens a generator holds at most
        self._entries: BudgetedEntries[_Entry] = BudgetedEntries(budget)
        self._decoding: dict[str, int] = {}  # requests taken and not put back, per conversation
        self._dropped: set[str] = set()  # conversations dropped while some of them decoded
        self._lock = threading.Lock()

    def take(self, conversation_id: str, prompt: list[int], cap: int) -> tuple[Any | None, int]:
        """The conversation's generator rewound to the longest prefix of ``prompt`` it holds, and
        that prefix's length (None, 0: nothing to reuse). At least the prompt's last token is
        left to prefill (the first answer token is read from its logits), and the generator must
        have room for the rest of the prompt and ``cap`` answer tokens. The generator is the
        caller's now, who gives it back (or None) with ``put``, whatever happens.

        The held tokens' last two are never reused: the last one sampled has no KV yet, and
        onnxruntime-genai 0.18 refuses a rewind of its dynamic cache to the length it holds."""
        with self._lock:
            entry = self._entries.pop(conversation_id)
            self._decoding[conversation_id] = self._decoding.get(conversation_id, 0) + 1
        if entry is None:
            return None, 0
        shared = min(shared_prefix(entry.tokens, prompt), len(entry.tokens) - 2, len(prompt) - 1)
        if shared <= 0 or len(prompt) + cap > self._max_length:
            return None, 0
        try:
            entry.generator.rewind_to(shared)
        except RuntimeError as err:  # a cache: the request prefills it all instead
            log.warning("conversation %s: kept KV not reusable (%s)", conversation_id, err)
            return None, 0
        return entry.generator, shared

    def put(self, conversation_id: str, generator: Any | None) -> None:
        """A request that ``take`` gave the conversation's KV (or none) ended: keep ``generator``
        (its KV and tokens; None: nothing to keep) for the conversation's next request."""
        tokens = [] if generator is None else [int(t) for t in generator.get_sequence(0)]
        nbytes = len(tokens) * self._token_bytes
        with self._lock:
            left = self._decoding.pop(conversation_id, 1) - 1
            dropped = conversation_id in self._dropped
            if left:
                self._decoding[conversation_id] = left
            else:
                self._dropped.discard(conversation_id)
            if tokens and not dropped:
                self._entries.put(conversation_id, _Entry(generator, tokens), nbytes)

    def drop(self, conversation_id: str) -> None:
        with self._lock:
            self._entries.drop(conversation_id)
            if conversation_id in self._decoding:
                self._dropped.add(conversation_id)

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return self._entries.sizes()
