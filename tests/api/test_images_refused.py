"""Images sent to a preset that cannot see (the toy: text and audio in): ``/v1/models`` says what
the model takes, and an ``input_image`` item (Realtime) or an ``image_url`` part (chat
completions) is refused with ``unsupported_modality``, naming what the model takes; nothing is
added and the session goes on. Against a real server, with the openai SDK and raw httpx."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from duplex.api.chat_request import parse_request
from duplex.api.errors import APIError
from harness.server import ServerProcess
from tests.api.helpers import API_KEY, AUTH, realtime, user_text


def png_data_url() -> str:
    """A real 8x8 PNG, as a data URL."""
    import av

    frame = av.VideoFrame.from_ndarray(np.full((8, 8, 3), 200, np.uint8), format="rgb24")
    out = io.BytesIO()
    with av.open(out, "w", format="image2pipe") as container:
        stream = container.add_stream("png")
        stream.width, stream.height, stream.pix_fmt = 8, 8, "rgb24"
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")


async def test_models_says_what_the_model_takes_and_gives(server: ServerProcess) -> None:
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    (model,) = [m async for m in client.models.list()]
    assert model.model_extra == {"input_modalities": ["text", "audio"],
                                 "output_modalities": ["text", "audio"]}


async def test_an_image_item_is_refused_naming_the_model_s_inputs(server: ServerProcess) -> None:
    image = {"type": "input_image", "image_url": png_data_url()}
    async with realtime(server) as rt:
        await rt.wait("session.created")
        await rt.connection.send({"type": "conversation.item.create", "item": {
            "id": "item_seen", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "What is this?"}, image]}})
        error = (await rt.wait("error")).error
        assert (error.code, error.param) == ("unsupported_modality", "item.content")
        assert "takes text and audio, not images" in error.message
        # Nothing was added, and the session goes on.
        await rt.connection.send({"type": "conversation.item.create",
                                  "item": {"id": "item_text", **user_text("Hello.")}})
        assert (await rt.wait("conversation.item.done")).item.id == "item_text"
    assert [e.item.id for e in rt.of("conversation.item.added")] == ["item_text"]


async def test_an_image_part_of_a_chat_message_is_refused(server: ServerProcess) -> None:
    body = {"model": "any", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": png_data_url()}}]}]}
    async with httpx.AsyncClient(timeout=30) as http:
        refused = await http.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_modality", "messages.0.content.1")
    assert "takes text and audio, not images" in error["message"]


def test_a_model_that_sees_takes_data_urls_and_never_fetches_a_remote_one() -> None:
    def body(url: str) -> dict:
        return {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]}]}

    seeing = ("text", "audio", "image")
    assert parse_request(body(png_data_url()), ["default"], seeing).messages
    with pytest.raises(APIError) as refused:
        parse_request(body("http://169.254.169.254/latest/meta-data"), ["default"], seeing)
    assert refused.value.status == 400
    assert refused.value.param == "messages.0.content.0.image_url.url"
    assert "data URL" in refused.value.message
