"""The talker's cache of a conversation's user rows (``talker_rows.py``): what it reuses, and its budget."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from pipeline.models.qwen3_omni.talker_rows import UserRowsCache, shared_rows
from pipeline.scheduling.conversation_book import Budget


def kv(rows: int) -> DynamicCache:
    """A one-layer cache of ``rows`` tokens (2 heads of 4), each token's values its index."""
    cache = DynamicCache()
    values = torch.arange(rows, dtype=torch.float32).view(1, 1, rows, 1).expand(1, 2, rows, 4)
    cache.update(values.clone(), values.clone(), 0)
    return cache


def test_the_longest_shared_prefix_is_reused_and_the_rest_cropped() -> None:
    rows = torch.randn(6, 8)
    assert shared_rows(rows, rows) == 6
    assert shared_rows(rows, rows[:4]) == 4
    changed = rows.clone()
    changed[3, 7] += 1e-6  # one value of one row: from there on nothing is shared
    assert shared_rows(rows, changed) == 3
    assert shared_rows(rows, torch.randn(6, 9)) == 0
    cache = UserRowsCache(Budget())
    cache.put("c", rows, kv(6))
    got, n = cache.take("c", torch.cat([changed, torch.randn(2, 8)]))
    assert n == 3 and got is not None and got.get_seq_length() == 3
    assert torch.equal(got.layers[0].values[0, 0, :, 0], torch.tensor([0.0, 1.0, 2.0]))
    assert cache.take("c", rows) == (None, 0)  # taken: the request owns it until it gives it back
    cache.put("c", rows, kv(6))
    assert cache.take("c", torch.randn(6, 8)) == (None, 0)  # nothing shared: a full prefill


def test_the_budget_evicts_least_recently_kept_and_skips_what_is_too_big() -> None:
    probe = UserRowsCache(Budget())
    probe.put("x", torch.randn(6, 8), kv(6))
    size = probe.sizes()["x"]
    cache = UserRowsCache(Budget(max_bytes=2 * size, max_bytes_per_conversation=size))
    for cid in ("a", "b", "c"):
        cache.put(cid, torch.randn(6, 8), kv(6))
    assert set(cache.sizes()) == {"b", "c"}
    cache.put("big", torch.randn(7, 8), kv(7))  # over the per-conversation budget: not kept
    assert set(cache.sizes()) == {"b", "c"}
    cache.drop("b")
    assert set(cache.sizes()) == {"c"}
