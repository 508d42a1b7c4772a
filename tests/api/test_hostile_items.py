"""Caps on what a client's own conversation items hold (``conversation.item.create``): the count
of items and the bytes of their audio. Past a cap the item is refused with an ``error`` naming the
field and the cap, nothing is added, and the session goes on: deleting items makes room again and
responses are still answered. Over the real WebSocket, with the openai SDK as the client."""

from __future__ import annotations

import base64
import logging
from typing import Any

from duplex.session.client_events import MAX_CLIENT_AUDIO_BYTES, MAX_CLIENT_ITEMS
from harness.server import ServerProcess
from tests.api.helpers import SHORT_ANSWER, RealtimeClient, realtime, user_text

log = logging.getLogger(__name__)

HELD_RATE = 16000  # the history keeps a client's audio as 16 kHz float32
CAP_SECONDS = MAX_CLIENT_AUDIO_BYTES / (HELD_RATE * 4)
ULAW_RATE = 8000  # the cheapest input format to send minutes of audio in


def ulaw_item(item_id: str, seconds: float) -> dict[str, Any]:
    """A user item with ``seconds`` of μ-law silence (the session's input format is pcmu)."""
    audio = base64.b64encode(b"\xff" * int(seconds * ULAW_RATE)).decode("ascii")
    return {"id": item_id, "type": "message", "role": "user",
            "content": [{"type": "input_audio", "audio": audio}]}


async def create(rt: RealtimeClient, item: dict[str, Any]) -> None:
    await rt.connection.send({"type": "conversation.item.create", "item": item})


async def refused(rt: RealtimeClient, count: int) -> Any:
    """The ``count``-th error of the connection, once it came."""
    return (await rt.wait("error", count)).error


async def test_the_count_of_client_items_is_capped_and_deleting_makes_room(server: ServerProcess) -> None:
    async with realtime(server) as rt:
        await rt.wait("session.created")
        for n in range(MAX_CLIENT_ITEMS):
            await create(rt, {"id": f"item_{n}", **user_text(f"Note number {n}.")})
        await rt.wait("conversation.item.done", MAX_CLIENT_ITEMS)
        await create(rt, {"id": "item_over", **user_text("One too many.")})
        error = await refused(rt, 1)
        assert (error.code, error.param) == ("item_limit_exceeded", "item")
        assert f"MAX_CLIENT_ITEMS = {MAX_CLIENT_ITEMS}" in error.message

        await rt.connection.conversation.item.delete(item_id="item_0")
        await rt.wait("conversation.item.deleted")
        await create(rt, {"id": "item_over", **user_text("Room again.")})
        added = await rt.wait("conversation.item.done", MAX_CLIENT_ITEMS + 1)
        assert added.item.id == "item_over"

        await rt.connection.response.create(response={"max_output_tokens": SHORT_ANSWER})
        done = await rt.wait("response.done")
        assert done.response.status == "completed"
    assert [e.item.id for e in rt.of("conversation.item.done")].count("item_over") == 1
    assert len(rt.of("error")) == 1, rt.of("error")


async def test_the_audio_of_client_items_is_capped_in_bytes(server: ServerProcess) -> None:
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await rt.connection.session.update(session={
            "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"},
                                                    "turn_detection": None}}})
        await rt.wait("session.updated")
        await create(rt, ulaw_item("long_a", CAP_SECONDS * 0.6))
        await rt.wait("conversation.item.done")
        await create(rt, ulaw_item("long_b", CAP_SECONDS * 0.5))  # 1.1 caps held in all
        error = await refused(rt, 1)
        assert (error.code, error.param) == ("item_limit_exceeded", "item.content")
        assert f"MAX_CLIENT_AUDIO_BYTES = {MAX_CLIENT_AUDIO_BYTES}" in error.message

        await rt.connection.conversation.item.delete(item_id="long_a")
        await rt.wait("conversation.item.deleted")
        await create(rt, ulaw_item("long_b", CAP_SECONDS * 0.5))
        added = await rt.wait("conversation.item.done", 2)
        log.info("item %s accepted once the first was deleted", added.item.id)
        assert added.item.id == "long_b"
    assert len(rt.of("error")) == 1, rt.of("error")
