"""``BudgetedEntries``: what a stage caches per conversation stays within its budget, the least
recently kept evicted first (pipeline/scheduling/cache_budget.py)."""

from __future__ import annotations

from pipeline.scheduling.cache_budget import BudgetedEntries
from pipeline.scheduling.conversation_book import Budget


def test_the_least_recently_kept_entries_go_first_when_over_budget() -> None:
    entries: BudgetedEntries[str] = BudgetedEntries(Budget(max_bytes=100, max_bytes_per_conversation=60))
    entries.put("a", "A", 40)
    entries.put("b", "B", 40)
    entries.put("a", "A2", 30)  # kept again: now the most recent
    assert entries.sizes() == {"b": 40, "a": 30}
    entries.put("c", "C", 50)  # 120 > 100: b, the least recently kept, goes
    assert entries.sizes() == {"a": 30, "c": 50}
    assert entries.pop("a") == "A2" and entries.pop("a") is None
    assert entries.sizes() == {"c": 50}


def test_an_entry_over_the_per_conversation_budget_is_not_kept_and_replaces_the_old() -> None:
    entries: BudgetedEntries[str] = BudgetedEntries(Budget(max_bytes=100, max_bytes_per_conversation=60))
    entries.put("a", "A", 40)
    entries.put("a", "too big", 61)
    assert entries.sizes() == {} and entries.pop("a") is None
    entries.put("b", "B", 10)
    entries.drop("b")
    entries.drop("never kept")
    assert entries.sizes() == {}
