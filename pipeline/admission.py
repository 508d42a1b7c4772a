"""Admission of a request into the pipeline: the global bound and each owner's fair share.

The rule (``check``), with ``max`` = ``max_in_flight`` and ``share`` = ``owner_share`` (default
``max(1, max_in_flight // 4)``):
- a request is refused when ``max`` requests are in flight, whoever sends it;
- an owner (``OmniRequest.owner``: a session, an API client) that holds fewer than ``share``
  requests is admitted whenever a slot is free;
- an owner that already holds ``share`` or more is admitted only while more than ``share`` slots
  are free, so the last ``share`` slots are left for owners below their share: one owner's flood
  fails that owner (``PipelineOverloaded``) and never the next ordinary turn of another;
- a request without an owner (``None``) is bounded by ``max`` only, as before owners existed.

Stateless: it reads the owners of the requests in flight, which the coordinator keeps in its
flights (a count over at most ``max_in_flight`` entries): no second book to keep in step.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.config import PipelineConfig
from pipeline.flights import PipelineOverloaded


def owner_share(config: PipelineConfig) -> int:
    """Requests one owner may hold however full the pipeline is."""
    return config.owner_share or max(1, config.max_in_flight // 4)


def check(config: PipelineConfig, in_flight: Iterable[str | None], owner: str | None) -> None:
    """Raise PipelineOverloaded when a request of ``owner`` may not start now; ``in_flight``: the
    owners of the requests in flight (one entry per request)."""
    owners = list(in_flight)
    free = config.max_in_flight - len(owners)
    if free <= 0:
        raise PipelineOverloaded(
            f"{len(owners)} requests in flight (max_in_flight={config.max_in_flight})"
        )
    if owner is None:
        return
    share = owner_share(config)
    held = owners.count(owner)
    if held >= share and free <= share:
        raise PipelineOverloaded(
            f"owner {owner!r} holds {held} of {len(owners)} requests in flight; beyond its share "
            f"({share}) it may not take the last {share} of max_in_flight={config.max_in_flight}"
        )
