"""What a stage caches per conversation, within its ``Budget``: the bookkeeping that the caches of
model runners share (the offline LM's kept KV, ``pipeline/models/offline/lm_cache.py``; the
Qwen3-Omni talker's user rows, ``pipeline/models/qwen3_omni/talker_rows.py``).

A ``BudgetedEntries`` holds one entry per conversation with its size in bytes. Putting an entry
replaces the conversation's old one; an entry over the per-conversation budget is not kept, and
entries are evicted least recently put first until the total is within the stage's budget. The
owner (the cache) decides what an entry is and when it is taken; nothing here is thread-safe.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from pipeline.scheduling.conversation_book import Budget

T = TypeVar("T")


class BudgetedEntries(Generic[T]):
    def __init__(self, budget: Budget) -> None:
        self._budget = budget
        self._entries: dict[str, tuple[T, int]] = {}  # least recently put first

    def pop(self, conversation_id: str) -> T | None:
        """The conversation's entry, which the caller now owns (None: none kept)."""
        entry = self._entries.pop(conversation_id, None)
        return None if entry is None else entry[0]

    def put(self, conversation_id: str, value: T, nbytes: int) -> None:
        """Keep ``value`` (``nbytes`` of it) as the conversation's entry, within the budget."""
        self._entries.pop(conversation_id, None)
        if nbytes > self._budget.max_bytes_per_conversation:
            return
        self._entries[conversation_id] = (value, nbytes)
        total = sum(size for _, size in self._entries.values())
        for cid in list(self._entries):
            if total <= self._budget.max_bytes:
                break
            total -= self._entries.pop(cid)[1]

    def drop(self, conversation_id: str) -> None:
        self._entries.pop(conversation_id, None)

    def sizes(self) -> dict[str, int]:
        return {cid: size for cid, (_, size) in self._entries.items()}
