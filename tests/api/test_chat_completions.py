"""``POST /v1/chat/completions`` with the real ``openai`` SDK (and raw httpx where the SDK hides the
wire), against a real server (toy preset, stage processes). Runs in the loopback-only namespace."""

from __future__ import annotations

import asyncio
import base64
import io
import wave
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai import AsyncOpenAI

from harness.server import ServerProcess
from harness.speech import speech_wav
from pipeline.models.toy.runners import answer_token
from tests.api.helpers import (
    API_KEY,
    AUTH,
    PCM_RATE,
    SHORT_ANSWER,
    aborts,
    answer_samples,
    decode_pcm16,
    eventually,
    pipeline_idle,
    rms,
)

MODEL = "gpt-4o-audio-preview"
SPEAK_PCM16 = {"modalities": ["text", "audio"], "audio": {"voice": "default", "format": "pcm16"}}
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY) as sdk:
        yield sdk


async def test_streamed_text_and_audio(client: AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=HELLO, stream=True, stream_options={"include_usage": True},
        max_completion_tokens=SHORT_ANSWER, **SPEAK_PCM16)
    chunks = [chunk async for chunk in stream]
    assert {c.id for c in chunks} == {chunks[0].id} and {c.model for c in chunks} == {MODEL}
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    transcript = "".join(d.audio.transcript for d in deltas if d.audio and d.audio.transcript)
    audio = decode_pcm16([d.audio.data for d in deltas if d.audio and d.audio.data])
    assert len(transcript.split()) == SHORT_ANSWER
    assert not any(d.content for d in deltas)
    assert len(audio) == answer_samples(transcript)
    assert rms(audio) > 0.05
    assert len({d.audio.id for d in deltas if d.audio}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == SHORT_ANSWER


async def test_streamed_text_only(client: AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(model=MODEL, messages=HELLO, stream=True,
                                                  max_completion_tokens=SHORT_ANSWER)
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len(text.split()) == SHORT_ANSWER
    assert not any(c.choices[0].delta.audio for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage is None


def toy_answer(samples_16k: int, words: int) -> list[str]:
    """What the toy says to a turn of audio: a pure function of its length at 16 kHz."""
    seed = samples_16k % 997
    return [f"w{answer_token(seed, k)}" for k in range(words)]


@pytest.mark.parametrize(("fmt", "input_rate"), [("wav", 44100), ("pcm16", 8000)])
async def test_spoken_question_gets_a_spoken_answer(client: AsyncOpenAI, fmt: str,
                                                    input_rate: int) -> None:
    wav = speech_wav("What is the weather like tomorrow?", input_rate)
    data = base64.b64encode(wav.read_bytes()).decode()
    with wave.open(str(wav)) as w:
        at_16k = round(w.getnframes() * 16000 / input_rate)
    completion = await client.chat.completions.create(
        model=MODEL, max_completion_tokens=SHORT_ANSWER, modalities=["text", "audio"],
        audio={"voice": "default", "format": fmt},
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": [
            {"type": "text", "text": "Please answer this:"},
            {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]}])
    message = completion.choices[0].message
    assert completion.model == MODEL and completion.choices[0].finish_reason == "stop"
    assert message.content is None
    # The toy's answer is a function of the audio's length at 16 kHz: decoded and resampled right.
    assert message.audio.transcript.split() == toy_answer(at_16k, SHORT_ANSWER)
    data = base64.b64decode(message.audio.data)
    if fmt == "wav":
        with wave.open(io.BytesIO(data)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (PCM_RATE, 1, 2)
            data = w.readframes(w.getnframes())
    samples = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768
    assert len(samples) == answer_samples(message.audio.transcript)
    assert rms(samples) > 0.05
    assert completion.usage is not None and completion.usage.completion_tokens == SHORT_ANSWER


NOT_A_WAV = base64.b64encode(b"RIFF" + b"\0" * 64).decode()
BAD_REQUESTS: list[tuple[Any, str | None, str]] = [
    (b"{not json", None, "json"),
    ({"model": MODEL}, "messages", "messages"),
    ({"model": MODEL, "messages": []}, "messages", "messages"),
    ({"model": MODEL, "messages": HELLO, "modalities": ["text", "audio"]}, "audio", "audio"),
    ({"model": MODEL, "messages": HELLO, "modalities": ["text", "audio"],
      "audio": {"voice": "nobody", "format": "wav"}}, "audio.voice", "nobody"),
    ({"model": MODEL, "messages": HELLO, "modalities": ["text", "audio"], "stream": True,
      "audio": {"voice": "default", "format": "wav"}}, "audio.format", "pcm16"),
    ({"model": MODEL, "messages": HELLO, "modalities": ["video"]}, "modalities.0", "modalities"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "!!!", "format": "wav"}}]}]},
     "messages.0.content.0.input_audio.data", "base64"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": NOT_A_WAV, "format": "wav"}}]}]},
     "messages.0.content.0.input_audio.data", "decodable"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", "role"),
    ({"model": MODEL, "messages": HELLO, "n": 2}, "n", "n"),
]


@pytest.mark.parametrize(("body", "param", "needle"), BAD_REQUESTS)
async def test_bad_requests_get_openai_errors(server: ServerProcess, body: Any, param: str | None,
                                              needle: str) -> None:
    async with httpx.AsyncClient(headers=AUTH) as http:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = await http.post(f"{server.url}/v1/chat/completions", **kwargs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert needle.lower() in error["message"].lower()


async def test_sdk_raises_the_server_message(client: AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="unknown voice 'alloy'"):
        await client.chat.completions.create(model=MODEL, messages=HELLO,
                                             modalities=["text", "audio"],
                                             audio={"voice": "alloy", "format": "wav"})


async def test_oversized_body_gets_413_and_the_server_goes_on(server: ServerProcess,
                                                              client: AsyncOpenAI) -> None:
    text = b"a" * (26 << 20)
    huge = b'{"model": "m", "messages": [{"role": "user", "content": "' + text + b'"}]}'
    async with httpx.AsyncClient(headers=AUTH) as http:
        response = await http.post(f"{server.url}/v1/chat/completions", content=huge)
    assert response.status_code == 413
    assert "larger than" in response.json()["error"]["message"]
    completion = await client.chat.completions.create(model=MODEL, messages=HELLO,
                                                      max_completion_tokens=SHORT_ANSWER)
    assert len(completion.choices[0].message.content.split()) == SHORT_ANSWER


async def test_client_disconnect_aborts_the_request(server: ServerProcess) -> None:
    """A long answer (seconds to generate): the client leaves after its first chunk, or before."""
    aborted = aborts(server)
    body = {"model": MODEL, "messages": HELLO, "stream": True, **SPEAK_PCM16}
    async with httpx.AsyncClient(headers=AUTH) as http:
        async with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            first = await anext(response.aiter_lines())
            assert first.startswith("data: ")
        await eventually(lambda: aborts(server) == aborted + 1, "the streamed request's abort")
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{server.url}/v1/chat/completions", timeout=0.5,
                            json={**body, "stream": False,
                                  "audio": {"voice": "default", "format": "wav"}})
    await eventually(lambda: aborts(server) == aborted + 2 and pipeline_idle(server),
                     "the second abort")


async def test_concurrent_completions_are_independent(client: AsyncOpenAI) -> None:
    questions = ["One?", "Two, please?", "And three?"]
    answers = await asyncio.gather(*(
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                       max_completion_tokens=SHORT_ANSWER) for q in questions))
    texts = [a.choices[0].message.content for a in answers]
    solo = await client.chat.completions.create(model=MODEL, max_completion_tokens=SHORT_ANSWER,
                                                messages=[{"role": "user", "content": "One?"}])
    assert texts[0] == solo.choices[0].message.content
    assert len(set(texts)) == len(texts)
    assert len({a.id for a in answers}) == len(answers)
