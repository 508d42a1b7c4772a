"""The streaming-failure contract and pipeline backpressure, against a server whose code2wav stage
fails every request at its first frame, after the thinker's text has gone out.

The failure is made by the preset alone, with no request knob: code2wav runs the toy's pass-through
``relay`` runner under the ``vocoder`` scheduler, which fails a request (the runner cannot stream)
as soon as the talker's first frame reaches it. The talker takes 1 s a frame, so every request is
still in flight for a second after its first text: long enough to meet ``max_in_flight: 1``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from harness.server import ServerProcess, run_server, write_preset
from tests.api.helpers import (
    API_KEY,
    AUTH,
    eventually,
    pipeline_idle,
    realtime,
    toy_pipeline,
    user_text,
)

FAILING = toy_pipeline(code2wav={"runner": "relay"}, talker={"options": {"step_delay_s": 1.0}})
BODY = {"model": "m", "messages": [{"role": "user", "content": "Hello?"}],
        "modalities": ["text", "audio"], "audio": {"voice": "default", "format": "pcm16"}}


@pytest.fixture(scope="module")
def failing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("failing")
    preset = write_preset(tmp / "preset.yaml", pipeline={**FAILING, "max_in_flight": 1},
                          api_key=API_KEY, pipeline_mode="inproc")
    with run_server(preset, tmp=tmp) as running:
        yield running


async def test_stream_failure_sends_the_error_and_no_done(failing: ServerProcess) -> None:
    async with httpx.AsyncClient(headers=AUTH, timeout=20) as http:
        async with http.stream("POST", f"{failing.url}/v1/chat/completions",
                               json={**BODY, "stream": True}) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
    assert "data: [DONE]" not in lines
    assert "error" in events[-1] and "code2wav" in events[-1]["error"]["message"]
    assert events[-1]["error"]["type"] == "server_error"
    # It failed after it started: the answer's text had gone out.
    assert any(e.get("choices") and (e["choices"][0]["delta"].get("audio") or {}).get("transcript")
               for e in events[:-1])
    await eventually(lambda: pipeline_idle(failing), "the failed request's cleanup")


async def test_sdk_stream_raises_the_failure(failing: ServerProcess) -> None:
    async with AsyncOpenAI(base_url=f"{failing.url}/v1", api_key=API_KEY) as client:
        stream = await client.chat.completions.create(**BODY, stream=True)
        with pytest.raises(openai.APIError, match="code2wav"):
            async for _ in stream:
                pass


async def test_failure_before_an_answer_is_a_500(failing: ServerProcess) -> None:
    async with AsyncOpenAI(base_url=f"{failing.url}/v1", api_key=API_KEY, max_retries=0) as client:
        with pytest.raises(openai.InternalServerError, match="code2wav") as failed:
            await client.chat.completions.create(**BODY)
    assert failed.value.status_code == 500


async def test_realtime_failure_is_an_error_and_a_failed_response(failing: ServerProcess) -> None:
    async with realtime(failing) as rt:
        await rt.wait("session.created")
        await rt.connection.conversation.item.create(item=user_text("Hello?"))
        await rt.connection.response.create()
        done = await rt.wait("response.done")
        error = await rt.wait("error")
    assert done.response.status == "failed"
    assert "code2wav" in error.error.message
    assert rt.types().index("error") < rt.types().index("response.done")


async def test_beyond_max_in_flight_is_a_503_with_retry_after(failing: ServerProcess) -> None:
    async with httpx.AsyncClient(headers=AUTH, timeout=20) as http:
        async with http.stream("POST", f"{failing.url}/v1/chat/completions",
                               json={**BODY, "stream": True}) as busy:
            assert busy.status_code == 200  # committed: in flight until its first frame fails
            refused = await http.post(f"{failing.url}/v1/chat/completions",
                                      json={**BODY, "stream": True})
            # Refused before its audio is decoded: undecodable audio still gets the 503, not a 400.
            garbage = {"role": "user", "content": [{"type": "input_audio", "input_audio": {
                "data": base64.b64encode(b"not a wav file").decode(), "format": "wav"}}]}
            unread = await http.post(f"{failing.url}/v1/chat/completions",
                                     json={**BODY, "messages": [garbage]})
        assert refused.status_code == 503
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "server_error"
        assert unread.status_code == 503, unread.text
