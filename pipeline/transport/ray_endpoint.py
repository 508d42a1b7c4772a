"""Ray transport: the Endpoint of a stage actor and the Endpoint of a front end (a coordinator).

Stage -> stage and front end -> stage: batches go through ``StageActor.deliver`` calls, one at a
time per sender and target (``ray_wire.Link``). Stage -> front end: a front end is a Ray driver,
which cannot serve calls, so it long-polls every stage actor (``StageActor.poll``, one call
outstanding per stage, answered as soon as the stage has something for it or after ``POLL_WAIT_S``).

A request's data that a link could not deliver (``ray_wire.Link``) fails the request: a front end
hears a ``Failed`` for it at once (from itself for a Submit, from the sending stage otherwise).

Several front ends may share one set of stage actors. A stage remembers which front end each
request came from (the ``origin`` of its messages, carried on from stage to stage) and answers
that one; stage-wide messages (Ready, periodic StageStats) go to every front end, and a stage
replays its last Ready or StageCrashed to a front end that connects (or reconnects) later. Stats
tokens are per coordinator, so a front end rewrites them into ids unique across front ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ray.exceptions import RayError

from pipeline.proto import (
    COORDINATOR,
    Abort,
    ControlMessage,
    Failed,
    Ready,
    Shutdown,
    StageCrashed,
    StageStats,
    StatsRequest,
    StreamDone,
    Submit,
)
from pipeline.transport.inbox import Inbox
from pipeline.transport.ray_wire import Link, decode, encode, request_id_of

log = logging.getLogger(__name__)

POLL_WAIT_S = 1.0
"""How long a poll waits for messages before it returns empty (and the front end polls again)."""
FRONT_END_TIMEOUT_S = 30.0
"""A front end that has not polled for this long is gone: its undelivered messages are dropped."""
RETRY_S = 0.2
"""Pause before polling a stage again whose poll failed (the actor died, restarts, or is away)."""
ROUTE_MEMORY = 65536
"""Request -> front end entries a stage keeps (oldest forgotten first)."""


@dataclass
class _FrontBox:
    """What a stage holds for one front end until that front end's next poll takes it."""

    messages: list[ControlMessage] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    seen: float = field(default_factory=time.monotonic)


class StageEndpoint:
    """The endpoint of the stage in one stage actor, on the actor's event loop, for its lifetime.

    ``lookup(stage)`` returns the actor handle of another stage (resolved by name, on first use);
    ``on_crashed`` is called when the stage reports StageCrashed (its worker thread died).
    """

    def __init__(
        self, name: str, lookup: Callable[[str], Any], on_crashed: Callable[[], None]
    ) -> None:
        self.name = name
        self._lookup = lookup
        self._on_crashed = on_crashed
        self._inbox = Inbox()
        self._links: dict[str, Link] = {}
        self._fronts: dict[str, _FrontBox] = {}
        self._routes: OrderedDict[str, str] = OrderedDict()
        self._stats_fronts: OrderedDict[int, str] = OrderedDict()
        self._status: ControlMessage | None = None

    # --- Endpoint -------------------------------------------------------------------------

    async def recv(self) -> ControlMessage:
        return await self._inbox.get()

    def send(self, target: str, message: ControlMessage) -> None:
        if target == COORDINATOR:
            self._to_fronts(message)
            return
        link = self._links.get(target)
        if link is None:
            link = self._links[target] = Link(target, lambda: self._lookup(target), self._lost)
        rid = request_id_of(message)
        link.push((self._routes.get(rid) if rid is not None else None, message))

    def shm_bytes(self) -> int:
        return 0  # Ray's object store owns what is in transit, and frees it itself

    def close(self, linger_ms: int = 0) -> None:
        for link in self._links.values():
            link.close()

    # --- called by the actor --------------------------------------------------------------

    def accept(self, data: bytes) -> None:
        """A batch from a front end or another stage, in the order its sender sent it."""
        for origin, message in decode(data):
            if origin is not None:
                rid = request_id_of(message)
                if rid is not None:
                    _remember(self._routes, rid, origin)
                if isinstance(message, StatsRequest):
                    _remember(self._stats_fronts, message.token, origin)
            self._inbox.put(message)

    def set_status(self, message: Ready | StageCrashed) -> None:
        """What every front end hears first (a stage that could not start reports it this way)."""
        self._status = message

    async def poll(self, front: str, hello: bool, wait: float) -> bytes:
        """The messages for ``front`` (waiting up to ``wait`` s for some). ``hello``: the front end
        (re)connects and hears the stage's status first; what was queued for it before is stale."""
        box = self._fronts.get(front)
        if box is None or hello:
            box = self._fronts[front] = _FrontBox()
            if self._status is not None:
                box.messages.append(self._status)
        box.seen = time.monotonic()
        if not box.messages:
            try:
                await asyncio.wait_for(box.ready.wait(), wait)
            except TimeoutError:
                pass
        messages, box.messages = box.messages, []
        box.ready.clear()
        box.seen = time.monotonic()
        return encode([(None, m) for m in messages])

    def leave(self, front: str) -> None:
        self._fronts.pop(front, None)

    def _lost(self, rid: str, why: str) -> None:
        """This stage's output for ``rid`` did not reach the next stage: the request cannot end
        there, so its front end fails it (and aborts it everywhere) now."""
        self._to_fronts(Failed(rid, self.name, why))

    # --- routing to front ends ------------------------------------------------------------

    def _to_fronts(self, message: ControlMessage) -> None:
        if isinstance(message, (Ready, StageCrashed)):
            self._status = message
        if isinstance(message, StageCrashed):
            self._on_crashed()
        rid = request_id_of(message)
        if rid is not None:
            self._put(self._routes.get(rid), message)
        elif isinstance(message, StageStats) and message.token is not None:
            self._put(self._stats_fronts.pop(message.token, None), message)
        else:
            self._drop_silent_fronts()  # or stage-wide news would pile up for a dead front end
            for front in list(self._fronts):
                self._put(front, message)

    def _put(self, front: str | None, message: ControlMessage) -> None:
        box = self._fronts.get(front) if front is not None else None
        if box is None:
            return  # its front end left (or never polled): nobody to tell
        box.messages.append(message)
        box.ready.set()

    def _drop_silent_fronts(self) -> None:
        now = time.monotonic()
        for front, box in list(self._fronts.items()):
            # A live front end is never silent for long: its polls return every POLL_WAIT_S.
            if now - box.seen > FRONT_END_TIMEOUT_S:
                log.warning("stage %s: front end %s stopped polling; forgotten", self.name, front)
                del self._fronts[front]


def _remember(table: OrderedDict[Any, str], key: Any, value: str) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > ROUTE_MEMORY:
        table.popitem(last=False)


LostCallback = Callable[[str, str], None]
"""``(stage, why)``: the front end lost a stage actor (it died, restarted or is unreachable)."""


class FrontEndpoint:
    """A coordinator's endpoint on a front end (a Ray driver), from start until close.

    ``handles``: every stage's actor handle. ``on_lost`` is called once per loss of a stage;
    the stage's Ready (replayed when the poll reaches its actor again) then heals the coordinator.
    Requests submitted here and not yet ended are tracked (``open_requests``) so that the
    supervisor can clear them from the surviving stages after a loss.
    """

    name = COORDINATOR

    def __init__(self, handles: dict[str, Any], terminals: list[str], on_lost: LostCallback) -> None:
        self.front_id = f"front-{random.getrandbits(64):016x}"
        self._handles = handles
        self._terminals = frozenset(terminals)
        self._on_lost = on_lost
        self._inbox = Inbox()
        self._links = {stage: Link(stage, lambda h=h: h, self._lost) for stage, h in handles.items()}
        self._open: dict[str, set[str]] = {}
        self._tokens: dict[int, int] = {}
        self._token_ids = itertools.count(random.getrandbits(40) << 20)
        self._polls: list[asyncio.Task[None]] = []
        self.crashed: set[str] = set()
        """Stages whose last word was StageCrashed (could not start, or their worker died)."""

    def start(self) -> None:
        self._polls = [
            asyncio.create_task(self._poll(stage), name=f"ray-poll-{stage}") for stage in self._handles
        ]

    async def recv(self) -> ControlMessage:
        return await self._inbox.get()

    def send(self, target: str, message: ControlMessage) -> None:
        if isinstance(message, Shutdown):
            return  # the stage actors outlive this front end; leaving them is the supervisor's job
        if isinstance(message, Submit):
            self._open[message.payload.request_id] = set(self._terminals)
        elif isinstance(message, Abort):
            self._open.pop(message.request_id, None)
        elif isinstance(message, StatsRequest):
            unique = next(self._token_ids)
            self._tokens[unique] = message.token
            message = replace(message, token=unique)
        self._links[target].push((self.front_id, message))

    def open_requests(self) -> list[str]:
        return list(self._open)

    def forget(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def shm_bytes(self) -> int:
        return 0

    def close(self, linger_ms: int = 0) -> None:
        for task in self._polls:
            task.cancel()
        for link in self._links.values():
            link.close()

    async def leave(self, timeout: float) -> None:
        """Abort what this front end left open on every stage, then tell every stage to forget it
        (the stages outlive it and serve other front ends: nothing of its own may stay there)."""
        for rid in self.open_requests():
            for stage in self._handles:
                self.send(stage, Abort(rid))
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(link.drained() for link in self._links.values()))
            await asyncio.gather(*(h.leave.remote(self.front_id) for h in self._handles.values()))

    def _lost(self, rid: str, why: str) -> None:
        """A request's Submit did not reach its entry stage: no stage will answer it, so the
        coordinator hears that it failed, as from a stage (``Failed``), instead of waiting."""
        self._receive(Failed(rid, "pipeline", why))

    def _receive(self, message: ControlMessage) -> None:
        if isinstance(message, StageCrashed):
            self.crashed.add(message.source)
        elif isinstance(message, Ready):
            self.crashed.discard(message.source)
        elif isinstance(message, StageStats) and message.token is not None:
            token = self._tokens.pop(message.token, None)
            if token is None:
                return
            message.token = token
        elif isinstance(message, StreamDone) and message.source in self._terminals:
            pending = self._open.get(message.payload.request_id)
            if pending is not None:
                pending.discard(message.source)
                if not pending:
                    del self._open[message.payload.request_id]
        self._inbox.put(message)

    async def _poll(self, stage: str) -> None:
        """Poll one stage for as long as this front end lives; report its losses."""
        handle = self._handles[stage]
        incarnation: str | None = None
        hello, lost = True, False
        while True:
            try:
                current, data = await handle.poll.remote(self.front_id, hello, POLL_WAIT_S)
            except RayError as err:
                if not lost:
                    lost = True
                    self._on_lost(stage, f"stage actor lost: {type(err).__name__}: {err}")
                hello = True
                await asyncio.sleep(RETRY_S)
                continue
            if incarnation is not None and current != incarnation and not lost:
                # Restarted between two polls: the loss must be reported before its new Ready.
                self._on_lost(stage, "stage actor restarted")
            incarnation, hello, lost = current, False, False
            for _, message in decode(data):
                self._receive(message)
