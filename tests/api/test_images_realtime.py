"""``input_image`` items over the Realtime WebSocket (and ``image_url`` parts of chat completions)
on the tiny Qwen3-Omni preset, which sees.

Against a real server with the openai SDK: ``/v1/models`` lists images among the inputs; a PNG, a
JPEG and a WebP item are added to the conversation (their image parts shown), kept in history and
read by the model: the answer's input tokens grow by exactly each image's vision tokens and its two
markers (the tiny image processor scales a 64 x 96 picture to 6 tokens). Bad images (corrupt, a
decompression bomb, a GIF, a remote URL) and more images than an item or a conversation may hold
get a clear ``error`` naming the field, nothing is added, and the session goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from openai import AsyncOpenAI

from duplex.protocol.images import MAX_CONVERSATION_IMAGES, MAX_IMAGES_PER_ITEM
from harness.server import ServerProcess, every_stage, run_server, write_preset
from tests.api.helpers import API_KEY, realtime
from tests.api.test_images_decode import bomb_png, data_url, encoded, gradient

MANUAL = {"type": "realtime", "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}}
VISION_TOKENS = 6 + 2  # 64 x 96 pixels: a 4 x 6 patch grid merged 2 x 2, and vision_start / end


@pytest.fixture(scope="module")
def seeing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("images")
    # One stage process: half the startup on a 2-core machine. Short answers: only the prompt counts.
    stages = every_stage("qwen3_omni_tiny", process="stages")
    stages["thinker"]["max_new_tokens"] = 2
    preset = write_preset(tmp / "preset.yaml", base="qwen3_omni_tiny", api_key=API_KEY, stages=stages)
    with run_server(preset, tmp=tmp) as running:
        yield running


def image_part(fmt: str = "PNG", mime: str = "image/png") -> dict[str, str]:
    return {"type": "input_image", "image_url": data_url(encoded(gradient(64, 96), fmt), mime)}


def message(*content: dict[str, Any], item_id: str | None = None) -> dict[str, Any]:
    item = {"type": "message", "role": "user", "content": list(content)}
    return {**item, "id": item_id} if item_id else item


LOOK = {"type": "input_text", "text": "Look."}
NOISE = (np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8)  # a PNG of ~12 kB


async def input_tokens(server: ServerProcess, *content: dict[str, Any]) -> int:
    """The answer's input tokens for one item of ``content``, in a session of its own."""
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await rt.connection.session.update(session=MANUAL)
        await rt.connection.conversation.item.create(item=message(*content))
        await rt.wait("conversation.item.done")
        await rt.connection.response.create()
        done = await rt.wait("response.done")
        assert done.response.status == "completed", done
        return done.response.usage.input_tokens


async def test_models_lists_images_among_the_inputs(seeing: ServerProcess) -> None:
    client = AsyncOpenAI(base_url=f"{seeing.url}/v1", api_key=API_KEY)
    (model,) = [m async for m in client.models.list()]
    assert model.model_extra["input_modalities"] == ["text", "audio", "image"]


async def test_png_jpeg_and_webp_items_are_kept_and_read_by_the_model(seeing: ServerProcess) -> None:
    plain = await input_tokens(seeing, LOOK)
    assert await input_tokens(seeing, LOOK, image_part()) == plain + VISION_TOKENS
    parts = [image_part(), image_part("JPEG", "image/jpeg"), image_part("WEBP", "image/webp")]
    assert await input_tokens(seeing, LOOK, *parts) == plain + 3 * VISION_TOKENS
    async with realtime(seeing) as rt:
        await rt.wait("session.created")
        await rt.connection.conversation.item.create(item=message(LOOK, *parts, item_id="item_seen"))
        added = (await rt.wait("conversation.item.added")).item
        assert [c.type for c in added.content] == ["input_text", "input_image", "input_image", "input_image"]
        await rt.connection.conversation.item.retrieve(item_id="item_seen")
        kept = (await rt.wait("conversation.item.retrieved")).item
        assert kept.id == "item_seen" and [c.type for c in kept.content][1:] == ["input_image"] * 3


@pytest.mark.parametrize(("part", "param", "words"), [
    ({"type": "input_image", "image_url": data_url(encoded(NOISE, "PNG")[:2000], "image/png")},
     "item.content", "not a readable image/png image"),
    ({"type": "input_image", "image_url": data_url(bomb_png(100_000, 100_000), "image/png")},
     "item.content", "pixels"),
    ({"type": "input_image", "image_url": "data:image/gif;base64,R0lGODlhAQABAAAAACw="},
     "item.content.image_url", "image type 'image/gif' is not taken"),
    ({"type": "input_image", "image_url": "https://example.com/cat.png"},
     "item.content.image_url", "remote image URLs are not fetched"),
])
async def test_a_bad_image_is_refused_and_the_session_goes_on(
    seeing: ServerProcess, part: dict[str, str], param: str, words: str
) -> None:
    async with realtime(seeing) as rt:
        await rt.wait("session.created")
        await rt.connection.conversation.item.create(item=message(LOOK, part, item_id="item_bad"))
        error = (await rt.wait("error")).error
        assert error.param == param and words in error.message, error
        await rt.connection.conversation.item.create(item=message(LOOK, item_id="item_fine"))
        assert (await rt.wait("conversation.item.done")).item.id == "item_fine"
    assert [e.item.id for e in rt.of("conversation.item.added")] == ["item_fine"]


async def test_images_per_item_and_per_conversation_are_capped(seeing: ServerProcess) -> None:
    async with realtime(seeing) as rt:
        await rt.wait("session.created")
        await rt.connection.conversation.item.create(item=message(*[image_part()] * (MAX_IMAGES_PER_ITEM + 1)))
        error = (await rt.wait("error")).error
        assert error.code == "item_limit_exceeded" and f"at most {MAX_IMAGES_PER_ITEM} images" in error.message
        for i in range(MAX_CONVERSATION_IMAGES // MAX_IMAGES_PER_ITEM):
            await rt.connection.conversation.item.create(item=message(*[image_part()] * MAX_IMAGES_PER_ITEM))
            await rt.wait("conversation.item.done", i + 1)
        await rt.connection.conversation.item.create(item=message(image_part()))
        error = (await rt.wait("error", 2)).error
        assert error.code == "item_limit_exceeded" and "MAX_CONVERSATION_IMAGES" in error.message


async def test_creating_and_deleting_image_items_in_a_loop_is_rate_limited(seeing: ServerProcess) -> None:
    """Deleting frees an item's share of the conversation, not the decoding it cost: past the
    connection's burst (a conversation's whole share) images are refused before they are decoded."""
    async with realtime(seeing) as rt:
        await rt.wait("session.created")
        for n in range(1, 7):  # up to 48 images: the burst is 16, refilled at 4 a second
            await rt.connection.conversation.item.create(
                item=message(*[image_part()] * MAX_IMAGES_PER_ITEM, item_id=f"item_{n}"))
            await rt.wait_for(lambda n=n: rt.of("error") or len(rt.of("conversation.item.done")) == n)
            if rt.of("error"):
                break
            await rt.connection.conversation.item.delete(item_id=f"item_{n}")
            await rt.wait("conversation.item.deleted", n)
        error = rt.of("error")[0].error
        assert error.code == "rate_limited" and "images a second" in error.message, error
        assert n >= 3  # the burst went through first
        await rt.connection.conversation.item.create(item=message(LOOK, item_id="item_text"))
        assert (await rt.wait("conversation.item.done", n)).item.id == "item_text"


async def test_a_chat_completion_reads_an_image_url_part(seeing: ServerProcess) -> None:
    """The same data URLs as ``image_url`` parts of chat completions (decoded off the loop)."""
    client = AsyncOpenAI(base_url=f"{seeing.url}/v1", api_key=API_KEY)

    async def prompt_tokens(*parts: dict[str, Any]) -> int:
        answer = await client.chat.completions.create(model="any", modalities=["text"], messages=[
            {"role": "user", "content": [{"type": "text", "text": "Look."}, *parts]}])
        return answer.usage.prompt_tokens

    url = image_part()["image_url"]
    plain = await prompt_tokens()
    assert await prompt_tokens({"type": "image_url", "image_url": {"url": url}}) == plain + VISION_TOKENS
    with pytest.raises(Exception, match="not a readable image/jpeg image"):
        await prompt_tokens({"type": "image_url", "image_url": {"url": url.replace("image/png", "image/jpeg")}})
