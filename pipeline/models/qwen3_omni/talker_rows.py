"""The talker's KV of a conversation's earlier user turns, kept between its requests (a cache).

The talker's prefill reads the rows of every user turn of the history before the answer's rows
(as ``generate`` does), so without this its prefill grows with the conversation. A
``UserRowsCache`` keeps, per conversation, the talker's KV of the user rows its last request
prefilled, with those rows (the thinker's rows as the talker received them), and gives the next
request of the conversation the KV of the longest prefix of rows it shares with them, compared
exactly row by row: only the rows after that prefix are prefilled, at the positions that follow.

This is a cache, not conversation state: nothing depends on it being there. The thinker's kept
state and the coordinator's book decide what a conversation holds, and the rows say what is
reusable: a turn undone or rolled back (its rows are not in the next request's) only shortens the
prefix, and a missing entry costs a full prefill, never an error.

Who owns what: the talker runner owns one and drives it from its worker thread. An entry lives
from the release of the conversation's request that prefilled it until the conversation's next
request takes it (and gives back its own at its release), ``drop`` (the session closed, or the
book evicted the conversation), or eviction to stay within its ``Budget`` (least recently used
first; an entry over the per-conversation budget is not kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from pipeline.models.qwen3_omni.kv_pool import cache_bytes, crop_to
from pipeline.scheduling.cache_budget import BudgetedEntries
from pipeline.scheduling.conversation_book import Budget


@dataclass
class _Entry:
    rows: torch.Tensor
    """The user rows the KV holds [U, thinker hidden] (CPU)."""
    cache: DynamicCache


def shared_rows(kept: torch.Tensor, rows: torch.Tensor) -> int:
    """How many leading rows of ``rows`` equal those of ``kept``, exactly."""
    n = min(kept.shape[0], rows.shape[0])
    if n == 0 or kept.shape[1:] != rows.shape[1:]:
        return 0
    differs = (kept[:n] != rows[:n]).any(dim=1).nonzero()
    return int(differs[0]) if len(differs) else n


class UserRowsCache:
    def __init__(self, budget: Budget) -> None:
        self._entries: BudgetedEntries[_Entry] = BudgetedEntries(budget)

    def take(self, conversation_id: str, rows: torch.Tensor) -> tuple[DynamicCache | None, int]:
        """The KV of the longest prefix of ``rows`` the conversation's entry holds, cropped to it,
        and that prefix's length (None, 0: nothing to reuse). The entry is the caller's now."""
        entry = self._entries.pop(conversation_id)
        if entry is None:
            return None, 0
        n = shared_rows(entry.rows, rows)
        if n == 0:
            return None, 0
        crop_to(entry.cache, n)
        return entry.cache, n

    def put(self, conversation_id: str, rows: torch.Tensor, cache: DynamicCache) -> None:
        """Keep ``cache``, which holds exactly the KV of ``rows``, for the conversation's next request."""
        nbytes = cache_bytes(cache) + rows.numel() * rows.element_size()
        self._entries.put(conversation_id, _Entry(rows, cache), nbytes)

    def drop(self, conversation_id: str) -> None:
        self._entries.drop(conversation_id)

    def sizes(self) -> dict[str, int]:
        return self._entries.sizes()
