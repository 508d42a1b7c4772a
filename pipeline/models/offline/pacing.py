"""How the ``lm`` stage's decoders share the CPU with each other and with speech synthesis.

Several answers decode side by side (one CTranslate2 job and worker thread each, ``lm.py``) on a
CPU that the ``tts`` stage, which voices their first clauses, shares. What a caller waits for is
the first clause of its answer; the rest only has to come faster than it is spoken. So a spoken
answer's decoder, once its first ``free_tokens`` tokens are out (a first clause or two):

- waits while another spoken answer has not had its own first ``free_tokens`` yet (that one's
  prefill and first clause go first), at most ``hold_max_s`` at a time;
- and a new spoken answer starts only when none is in its first tokens (``LanguageModel.runnable``,
  oldest first), so first clauses come one after another rather than all late together;
- and then keeps to ``tokens_per_s``, still faster than speech, so the CPU goes to synthesis
  rather than to text that would only wait for its turn to be voiced.

An abort wakes a waiting decoder at once. The tokens are the same, only their timing changes.

Ownership: the ``lm`` stage's runner holds one ``Pacer`` for its life; each paced job holds one
``Ticket`` from its start until ``Pacer.end`` (its last token or its release). Both are shared by
the stage's thread and CTranslate2's worker threads, under the pacer's condition.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Ticket:
    """One paced job: its tokens so far, when its pacing began, whether it is still urgent."""

    count: int = 0
    since: float = 0.0
    urgent: bool = True


class Pacer:
    def __init__(self, free_tokens: int, tokens_per_s: float, hold_max_s: float = 2.0) -> None:
        self._free = max(1, free_tokens)
        self._rate = tokens_per_s
        self._hold_max_s = hold_max_s
        self._urgent = 0  # paced jobs that have not had their free tokens yet
        self._changed = threading.Condition()

    @property
    def enabled(self) -> bool:
        return self._rate > 0

    def idle(self) -> bool:
        """Whether no paced job is in its first tokens (a new one may start)."""
        with self._changed:
            return self._urgent == 0

    def begin(self) -> Ticket:
        """A paced job starts: it is urgent (its prefill comes next)."""
        with self._changed:
            self._urgent += 1
        return Ticket()

    def end(self, ticket: Ticket) -> None:
        """The job ended or was released (idempotent): it holds back nobody any more."""
        with self._changed:
            if ticket.urgent:
                ticket.urgent = False
                self._urgent -= 1
            self._changed.notify_all()  # also wakes a job waiting below whose stop was just set

    def after_token(self, ticket: Ticket, stop: threading.Event) -> None:
        """In the job's callback, after each token: wait until its next token is due."""
        ticket.count += 1
        if ticket.urgent:
            if ticket.count < self._free:
                return
            ticket.since = time.monotonic()
            self.end(ticket)
        held = time.monotonic()
        with self._changed:
            self._changed.wait_for(lambda: self._urgent == 0 or stop.is_set(),
                                   timeout=self._hold_max_s)
        ticket.since += time.monotonic() - held  # its pace resumes: no burst to catch up
        due = ticket.since + (ticket.count - self._free) / self._rate
        stop.wait(max(0.0, due - time.monotonic()))
