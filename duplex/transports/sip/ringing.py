"""Calls that ring while the app decides (``--call-webhook``): the table and each call's decision.

With a webhook, the agent (agent.py) does not answer a new SIP call itself. It puts a
:class:`RingingCall` in the server's :class:`RingingCalls`, rings (180), POSTs the webhook
(webhook.py) and waits, at most the decision timeout, for the app's answer, which the API router
(duplex/api/realtime_calls.py) hands in by the call's id:

- ``/accept`` with a session config: the agent builds the session with it and answers 200; the
  router's request returns once the session is admitted (or says why not);
- ``/reject`` with a SIP status (603 by default): the caller gets that status;
- nothing by the timeout: 480 Temporarily Unavailable;
- the webhook failed (no connection, a non-2xx answer) before a decision: 503 with Retry-After.

Each entry lives from the INVITE until the call is answered, refused, cancelled by the caller or
timed out, and is removed in :meth:`RingingCalls.ringing`'s exit whichever way it ends (a CANCEL
cancels the agent's wait, handler.py). A ringing call holds a session slot
(the registry's ``hold``, agent.py): no session of any transport takes it while the app decides. The table lives as long as the server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from duplex.session.config import SessionConfig

from .handler import CallRefused, SipCallInfo
from .transaction import REASONS
from .webhook import CallWebhook, incoming_call_event

log = logging.getLogger(__name__)

DECLINE = 603  # /reject without a status_code (OpenAI's default)
NO_DECISION = 480  # Temporarily Unavailable: nobody decided in time
WEBHOOK_FAILED = 503  # the app could not be asked: as when the server cannot take calls


@dataclass(frozen=True)
class Accept:
    config: SessionConfig


@dataclass(frozen=True)
class Reject:
    status: int


class AlreadyDecided(Exception):
    """The app decided on this call before (an accept or reject twice, or both)."""


class RingingCall:
    """One call ringing (module doc); owned by the agent's task that waits on it."""

    def __init__(self, call_id: str, info: SipCallInfo) -> None:
        loop = asyncio.get_running_loop()
        self.call_id = call_id
        self.info = info
        self.decision: asyncio.Future[Accept | Reject] = loop.create_future()
        # What became of an accept: None (the session is live) or the error to answer with.
        self.answered: asyncio.Future[Exception | None] = loop.create_future()
        self.log = logging.LoggerAdapter(log, {"session_id": call_id})

    async def accept(self, config: SessionConfig) -> None:
        """The app's ``/accept``: returns once the session is live; raises AlreadyDecided, or
        what kept the session from starting (TooManySessions, CallGone)."""
        self._decide(Accept(config))
        error = await asyncio.shield(self.answered)
        if error is not None:
            raise error

    def reject(self, status: int = DECLINE) -> None:
        """The app's ``/reject``: the caller gets ``status``; raises AlreadyDecided."""
        self._decide(Reject(status))

    def _decide(self, decision: Accept | Reject) -> None:
        if self.decision.done():
            raise AlreadyDecided(f"call {self.call_id!r} was decided on already")
        self.log.info("the app decided: %s", decision if isinstance(decision, Reject) else "accept")
        self.decision.set_result(decision)


class CallGone(Exception):
    """The call ended (cancelled by the caller, timed out) before the decision took effect."""


class RingingCalls:
    """The server's ringing calls by id, and how each one's decision is awaited (module doc)."""

    def __init__(self, webhook: CallWebhook, timeout_s: float) -> None:
        self.webhook = webhook
        self.timeout_s = timeout_s
        self._calls: dict[str, RingingCall] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def get(self, call_id: str) -> RingingCall | None:
        return self._calls.get(call_id)

    @contextmanager
    def ringing(self, call_id: str, info: SipCallInfo) -> Iterator[RingingCall]:
        """The call in the table for the block, which sets ``answered`` where it starts the
        session (or fails to); on the way out, however the block ends, the call leaves the table
        and an accept still waiting is told the call is gone."""
        call = RingingCall(call_id, info)
        self._calls[call_id] = call
        try:
            yield call
        finally:
            if not call.answered.done():
                call.answered.set_result(CallGone(f"call {call_id!r} ended before it was answered"))
            self._calls.pop(call_id, None)

    async def decision(self, call: RingingCall) -> SessionConfig:
        """Post the webhook and wait for the app: the accepted config, or CallRefused with the
        status the caller gets (module doc)."""
        post = asyncio.get_running_loop().create_task(
            self.webhook.deliver(incoming_call_event(call.call_id, call.info.headers)))
        post.add_done_callback(_retrieved)
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.wait({post, call.decision}, return_when=asyncio.FIRST_COMPLETED)
                if not call.decision.done():
                    failure = post.exception()
                    if failure is not None:
                        call.log.warning("refusing the call: the webhook failed (%s)", failure)
                        raise CallRefused(WEBHOOK_FAILED, REASONS[WEBHOOK_FAILED])
                    # Waited on, not awaited: a cancelled wait must not cancel the future.
                    await asyncio.wait({call.decision})
        except TimeoutError:
            call.log.info("no decision within %.1f s: refusing the call", self.timeout_s)
            raise CallRefused(NO_DECISION, REASONS[NO_DECISION]) from None
        finally:
            post.cancel()
        decision = call.decision.result()
        if isinstance(decision, Reject):
            raise CallRefused(decision.status, REASONS.get(decision.status, "Declined"))
        return decision.config


def _retrieved(task: asyncio.Task[None]) -> None:
    """A delivery that failed after the app decided changes nothing: its error is let go."""
    if not task.cancelled():
        task.exception()
