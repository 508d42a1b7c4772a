"""Bulk work on client input, off the event loop every session shares (DESIGN.md invariant 9).

Decoding and resampling a long upload (an ``input_audio_buffer.append`` of seconds of audio, a
``conversation.item.create`` of minutes, a big JSON message) is tens to hundreds of milliseconds
of CPU; on the loop it would delay every call's paced audio and VAD by as much. :func:`off_loop`
runs such work on a small thread pool of the process instead, and the caller awaits it.

Order: a session's client events are handled one at a time (``SessionBinding``), and a handler
awaits its own off-loop work before it returns, so a later event of that session waits for the
earlier decode and nothing is reordered; other sessions' events go on meanwhile.

Fairness: the pool has :data:`WORKERS` threads and a FIFO queue; since each session has at most
one piece of work in it at a time, a flooding client holds at most one worker, and what it may
queue at all is bounded by its audio budget (``duplex.session.client_events``). The work itself
runs in slices (``duplex.protocol.wire_audio``: base64 and the resampler take a few hundred
milliseconds of audio per call), so the thread never holds the GIL long against the loop.

The pool lives as long as the process (its threads are idle between uploads).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

# Two: a second client's upload need not wait for the first's, and the media path (the loop, the
# model stages) keeps the remaining cores of a small machine.
WORKERS = 2

_P = ParamSpec("_P")
_T = TypeVar("_T")


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(WORKERS, thread_name_prefix="duplex-offloop")


async def off_loop(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` on the pool; its exception, if any, is raised here."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(), functools.partial(fn, *args, **kwargs))
