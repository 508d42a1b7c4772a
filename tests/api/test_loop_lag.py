"""Big client inputs do not stall the server's event loop (DESIGN.md invariants 9 and 11).

Black-box, over the real WebSocket: minutes of audio in ``conversation.item.create`` events are
counted against the items' caps and the client's item audio budget before they are decoded, and
what is accepted is decoded off the loop. What the loop suffered is read from the server's own
``duplex_event_loop_lag_seconds`` histogram (a 100 ms timer's lateness), before and after.

The bound is behavioural, not a benchmark: no timer may fire :data:`MAX_LAG_S` late. Decoding
these uploads on the loop and checking the caps only after decoding (as the server once did) held
it for more than 2 s; with the checks first and the decoding off the loop, a 2-core machine under
a load of 13 stayed within 0.5 s. Each defence on its own (the decoding on a worker thread, the
refusal before decoding, the VAD over a long append in slices, one event per loop iteration) is
checked without a clock in tests/duplex/test_offloop_events.py.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import numpy as np

from duplex.session.client_events import ITEM_AUDIO_BURST_S
from harness.server import ServerProcess
from tests.api.helpers import (
    AUTH,
    PCM_RATE,
    SHORT_ANSWER,
    RealtimeClient,
    pcm16_b64,
    realtime,
    user_text,
)
from tests.api.test_hostile_items import create, ulaw_item

log = logging.getLogger(__name__)

LAG = "duplex_event_loop_lag_seconds"
MAX_LAG_S = 1.0  # a histogram bucket bound
ITEM_SECONDS = 119.0  # a whole longest turn, just under the 120 s cap, per item
# Items of as much μ-law as one WebSocket message (16 MiB) can carry, JSON around it included.
HUGE_SECONDS = 1450.0
HUGE_ITEMS = 4


def lag_histogram(server: ServerProcess) -> dict[str, float]:
    """The lag histogram's cumulative buckets by ``le``, and ``count``."""
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.startswith(f'{LAG}_bucket{{le="'):
            samples[key.split('"')[1]] = float(value)
        elif key == f"{LAG}_count":
            samples["count"] = float(value)
    return samples


def samples_above(before: dict[str, float], after: dict[str, float], bound: float) -> int:
    """Lag samples taken between two scrapes that exceeded ``bound`` (a bucket bound)."""
    le = repr(float(bound))
    return int((after["count"] - before["count"]) - (after[le] - before[le]))


def worst_bucket(before: dict[str, float], after: dict[str, float]) -> str:
    """The smallest bucket bound that holds every sample between the scrapes (for the log)."""
    total = after["count"] - before["count"]
    bounds = sorted((k for k in after if k != "count"), key=float)
    return next((le for le in bounds if after[le] - before[le] >= total), "+Inf")


def audio_item(item_id: str, seconds: float) -> dict[str, Any]:
    """A user item with ``seconds`` of 24 kHz pcm16 noise (the session's default input format)."""
    noise = np.random.default_rng(0).uniform(-0.1, 0.1, int(seconds * PCM_RATE)).astype(np.float32)
    return {"id": item_id, "type": "message", "role": "user",
            "content": [{"type": "input_audio", "audio": pcm16_b64(noise)}]}


async def outcomes(rt: RealtimeClient, count: int) -> None:
    """Until ``count`` items were either added or refused."""
    await rt.wait_for(lambda: len(rt.of("conversation.item.done")) + len(rt.of("error")) >= count)


async def answered(rt: RealtimeClient) -> None:
    """The conversation still works: a text turn is answered to the end."""
    await create(rt, user_text("Still there?"))
    await rt.connection.response.create(response={"max_output_tokens": SHORT_ANSWER})
    done = await rt.wait("response.done")
    assert done.response.status == "completed", done.response


async def test_minutes_of_item_audio_do_not_stall_the_loop(server: ServerProcess) -> None:
    """Two-minute items, decoded off the loop, between items of as much μ-law as a message can
    carry (~24 minutes, 16 kHz float32 of it ~90 MB), refused before anything is decoded: they pass
    the items' audio cap."""
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await rt.connection.session.update(session={
            "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}})
        await rt.wait("session.updated")
        before = lag_histogram(server)
        for n in range(HUGE_ITEMS):
            await create(rt, ulaw_item(f"long_{n}", ITEM_SECONDS))
            await create(rt, ulaw_item(f"huge_{n}", HUGE_SECONDS))
        await outcomes(rt, 2 * HUGE_ITEMS)
        after = lag_histogram(server)
        log.info("loop lag within %s s", worst_bucket(before, after))
        assert samples_above(before, after, MAX_LAG_S) == 0, f"lag up to {worst_bucket(before, after)} s"
        assert [e.item.id for e in rt.of("conversation.item.done")] == [f"long_{n}" for n in range(HUGE_ITEMS)]
        assert {(e.error.code, e.error.param) for e in rt.of("error")} == {("item_limit_exceeded", "item.content")}
        await answered(rt)


async def test_item_audio_beyond_the_budget_is_refused_before_decoding(server: ServerProcess) -> None:
    """Items created and deleted again stay under the items' caps, but not under the audio
    budget: past its burst the next is refused (``rate_limited``), and nothing is added."""
    rounds = int(ITEM_AUDIO_BURST_S // ITEM_SECONDS) + 3
    item = audio_item("churn", ITEM_SECONDS)
    async with realtime(server) as rt:
        await rt.wait("session.created")
        for n in range(rounds):
            await create(rt, item)
            await outcomes(rt, n + 1)
            if rt.of("error"):
                break
            await rt.connection.conversation.item.delete(item_id="churn")
            await rt.wait("conversation.item.deleted", n + 1)
        errors = rt.of("error")
        assert errors, f"{rounds} × {ITEM_SECONDS:.0f} s of item audio were all decoded"
        assert (errors[0].error.code, errors[0].error.param) == ("rate_limited", "item.content")
        assert len(rt.of("conversation.item.done")) == n, "the refused item was added"
        log.info("item %d refused: %s", n + 1, errors[0].error.message)
        await answered(rt)
