"""The parts both resumable transports share (docs/resume.md), without a server: the Outbox's
bound and order, and a Resumption's token in ``session.created``, its detach / attach bookkeeping in
the registry and the store, and its end. The transports' own tests (test_resume.py,
tests/e2e/test_webrtc_resume.py) run them over real connections."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from duplex.registry import SessionRegistry, SessionSlot
from duplex.session.resume import ResumeRefused, ResumeStore
from duplex.transports.binding import Closing
from duplex.transports.outbox import Outbox
from duplex.transports.resumption import AUDIO_DELTA, Resumption


def test_the_outbox_keeps_order_refuses_past_its_bound_and_forgets_a_closing() -> None:
    outbox = Outbox(limit=10)
    assert outbox.put("abcd") and outbox.put("efgh")
    assert not outbox.put("ijk")  # 11 bytes: refused, nothing queued
    outbox.close_after(Closing("bye"))
    assert len(outbox) == 3
    assert outbox.take() == ["abcd", "efgh"]  # the Closing was for a connection that is gone
    assert outbox.put("0123456789")  # taking freed the whole bound


class FakeSession:
    def __init__(self) -> None:
        self.lost: list[dict[str, int]] = []

    async def connection_lost(self, unsent_ms: dict[str, int]) -> None:
        self.lost.append(unsent_ms)


class FakeBinding:
    """A SessionBinding's share of a Resumption: its id, its slot, its session and its end."""

    def __init__(self, registry: SessionRegistry, session_id: str) -> None:
        self.id = session_id
        self.session = FakeSession()
        self.ended: list[str] = []
        self._registry = registry

    def admit(self) -> None:
        self._registry.admit(SessionSlot(self.id, "webrtc", self.close))

    async def close(self) -> None:
        await self.end("closed")

    async def end(self, reason: str) -> None:
        self.ended.append(reason)
        self._registry.release(self.id)


class Holder:
    def __init__(self, session_id: str) -> None:
        self.id = session_id
        self.expired = asyncio.Event()

    async def expire(self) -> None:
        self.expired.set()


def resumable(store: ResumeStore) -> tuple[Resumption, FakeBinding, SessionRegistry, Holder]:
    registry = SessionRegistry(2)
    holder = Holder("rtc_1")
    binding = FakeBinding(registry, holder.id)
    resumption = Resumption(holder, binding, registry, store)  # type: ignore[arg-type]
    resumption.admit("sk-key")
    return resumption, binding, registry, holder


async def test_the_token_goes_into_session_created_as_it_leaves_and_audio_waits_for_nobody() -> None:
    store = ResumeStore(30)
    resumption, _, _, holder = resumable(store)
    created: dict[str, Any] = {"type": "session.created", "session": {"id": holder.id}}
    leaving = resumption.outgoing(created)
    assert leaving is not None
    token = leaving["session"]["resume_token"]
    assert "resume_token" not in created["session"]  # what a recording saw holds no token
    audio = {"type": AUDIO_DELTA, "delta": "AAAA"}
    assert resumption.outgoing(audio) is audio
    await resumption.detach("peer closed", {})
    assert resumption.outgoing(audio) is None  # audio in flight is dropped, events are held
    assert store.take(token, "sk-key") is holder
    # A session whose store is off (resume_grace_s: 0) gets no token.
    off, *_ = resumable(ResumeStore(0))
    assert "resume_token" not in (off.outgoing(created) or {})["session"]


async def test_a_detached_session_keeps_its_slot_until_its_grace_period_ends() -> None:
    store = ResumeStore(0.05)
    resumption, binding, registry, holder = resumable(store)
    resumption.outgoing({"type": "session.created", "session": {}})
    await resumption.detach("peer closed", {"item_1": 40})
    slot = registry.get(holder.id)
    assert slot is not None and slot.detached and resumption.detached
    assert binding.session.lost == [{"item_1": 40}]  # the session cut what was in flight
    await asyncio.wait_for(holder.expired.wait(), 5)
    # The holder's expire ends it for good (a transport calls Resumption.end from it).
    await resumption.end("no resume within the grace period")
    assert binding.ended == ["no resume within the grace period"] and registry.get(holder.id) is None
    assert len(store) == 0 and not resumption.enabled


async def test_a_resume_attaches_and_an_end_kills_the_token() -> None:
    store = ResumeStore(30)
    resumption, binding, registry, holder = resumable(store)
    first = (resumption.outgoing({"type": "session.created", "session": {}}) or {})["session"]
    await resumption.detach("peer closed", {})
    assert store.take(first["resume_token"], "sk-key") is holder
    resumption.attach()
    slot = registry.get(holder.id)
    assert slot is not None and not slot.detached and not resumption.detached
    second = (resumption.outgoing({"type": "session.created", "session": {}}) or {})["session"]
    await resumption.end("hangup")
    await resumption.end("again")  # the store forgets once; the binding's own end is idempotent
    assert binding.ended == ["hangup", "again"] and len(store) == 0
    with pytest.raises(ResumeRefused):
        store.take(second["resume_token"], "sk-key")
    assert registry.get(holder.id) is None
