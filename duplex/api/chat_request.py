"""A chat completions request body, validated, and turned into the model's input messages.

What is taken (CONTRACT.md, as OpenAI does it): ``messages`` with string content or ``text`` and
``input_audio`` parts (WAV or MP3 at any rate and channel count, decoded with PyAV and resampled
to the model's 16 kHz mono), ``modalities``, ``audio: {voice, format}``, ``stream``,
``stream_options.include_usage``, ``max_completion_tokens`` / ``max_tokens``. Sampling options
(``temperature``, ...) are accepted and ignored: the preset decides them. Everything here is pure
and per request; nothing outlives the request.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Annotated, Any, Literal

import av
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from duplex.api.errors import APIError
from duplex.media.resample import Resampler
from duplex.protocol import images
from duplex.protocol.modalities import CODE, not_taken

MODEL_RATE = 16000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class InputAudio(_Strict):
    data: str
    format: Literal["wav", "mp3"]


class AudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class ImageUrl(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


class AudioRef(BaseModel):
    id: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, refusal, ... carry nothing for the model

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Annotated[TextPart | AudioPart | ImagePart,
                                  Field(discriminator="type")]] | None = None
    audio: AudioRef | None = None


class AudioOutput(_Strict):
    voice: str
    format: Literal["wav", "pcm16"]


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] = Field(default_factory=lambda: ["text"],
                                                       min_length=1)
    audio: AudioOutput | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=1)

    @property
    def speaks(self) -> bool:
        return "audio" in self.modalities

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def request_schema() -> dict[str, Any]:
    """ChatRequest's JSON schema with its definitions inlined, for the OpenAPI document: the
    ``$ref``s of an operation's schema resolve against the whole document, which has no
    ``$defs``."""
    schema = ChatRequest.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].rsplit("/", 1)[1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return inline(schema)


def _bad(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code, param=param)


def parse_request(body: Any, voices: list[str], inputs: tuple[str, ...]) -> ChatRequest:
    """The validated request, for a model that takes ``inputs`` (its input modalities); raises
    APIError 400 naming the offending parameter."""
    try:
        request = ChatRequest.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise _bad(f"{param}: {first['msg']}" if param else first["msg"], param) from None
    if request.speaks:
        if request.audio is None:
            raise _bad("'audio' (voice and format) is required when modalities include 'audio'",
                       "audio", "missing_required_parameter")
        if request.audio.voice not in voices:
            raise _bad(f"unknown voice {request.audio.voice!r} (voices: {voices})", "audio.voice")
        if request.stream and request.audio.format != "pcm16":
            raise _bad("streamed audio must use format 'pcm16'", "audio.format")
    _check_images(request, inputs)
    return request


def _check_images(request: ChatRequest, inputs: tuple[str, ...]) -> None:
    """``image_url`` parts: refused where the model does not see, and a remote URL always (the
    server fetches nothing on a client's behalf: only ``data:`` URLs)."""
    for i, message in enumerate(request.messages):
        parts = message.content if isinstance(message.content, list) else []
        for j, part in enumerate(parts):
            if not isinstance(part, ImagePart):
                continue
            param = f"messages.{i}.content.{j}"
            if "image" not in inputs:
                raise _bad(not_taken("image", inputs), param, CODE)
            if not part.image_url.url.startswith("data:"):
                raise _bad("remote image URLs are not fetched: send the image as a data URL",
                           f"{param}.image_url.url")
            if message.role != "user":
                raise _bad(f"images are only allowed in user messages, not {message.role}", param)
            try:
                images.parse_data_url(part.image_url.url)
            except images.ImageError as err:
                raise _bad(str(err), f"{param}.image_url.url", "invalid_image") from None


def _decode_audio(part: InputAudio, param: str, max_seconds: float) -> np.ndarray:
    """An ``input_audio`` part as float32 mono at 16 kHz."""
    try:
        data = base64.b64decode(part.data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("input_audio.data is not valid base64", param + ".data") from None
    mono: list[np.ndarray] = []
    rate = 0
    try:
        with av.open(io.BytesIO(data), format=part.format) as container:
            # Planar float at the file's own rate and layout; channels are averaged below at unity
            # gain (libswresample's own downmix is -3 dB, see duplex.audio).
            planar = av.AudioResampler(format="fltp")
            for frame in container.decode(audio=0):
                rate = frame.sample_rate
                mono.extend(f.to_ndarray().mean(axis=0) for f in planar.resample(frame))
                if sum(map(len, mono)) > max_seconds * rate:
                    raise _bad(f"input audio longer than {max_seconds:.0f} s", param + ".data")
            mono.extend(f.to_ndarray().mean(axis=0) for f in planar.resample(None))
    except av.error.FFmpegError as err:
        raise _bad(f"input_audio.data is not decodable {part.format}: {err}",
                   param + ".data") from None
    if not mono or rate <= 0:
        raise _bad("input_audio.data holds no audio", param + ".data")
    resampler = Resampler(rate, MODEL_RATE)
    head = resampler.push(np.concatenate(mono).astype(np.float32))
    return np.concatenate([head, resampler.flush()]).astype(np.float32)


def model_messages(request: ChatRequest, max_audio_s: float) -> list[dict[str, Any]]:
    """``OmniRequest.inputs["messages"]``; CPU-bound (audio and image decoding): run it off the
    event loop."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        texts: list[str] = []
        audio: list[np.ndarray] = []
        pictures: list[np.ndarray] = []
        parts = [TextPart(type="text", text=message.content)] if isinstance(message.content, str) \
            else message.content or []
        for j, part in enumerate(parts):
            if isinstance(part, ImagePart):  # parse_request checked it (a model that sees, a data URL)
                try:
                    pictures.append(images.decode(images.parse_data_url(part.image_url.url)))
                except images.ImageError as err:
                    raise _bad(str(err), f"messages.{i}.content.{j}.image_url.url", "invalid_image") from None
            elif isinstance(part, TextPart):
                texts.append(part.text)
            elif message.role != "user":
                raise _bad(f"input_audio is only allowed in user messages, not {message.role}",
                           f"messages.{i}.content.{j}")
            else:
                param = f"messages.{i}.content.{j}.input_audio"
                audio.append(_decode_audio(part.input_audio, param, max_audio_s))
        if message.audio is not None and not texts:
            # The server keeps no audio it sent: a reference cannot be resolved, its text can.
            raise _bad("assistant audio references are not kept by this server; send the "
                       "transcript as the message's content", f"messages.{i}.audio")
        text = "".join(texts) or None
        if text is None and not audio and not pictures:
            continue
        out.append({
            "role": "system" if message.role == "developer" else message.role,
            "text": text,
            "audio": np.concatenate(audio) if audio else None,
            "sample_rate": MODEL_RATE if audio else None,
            **({"images": pictures} if pictures else {}),
        })
    if sum(len(m["audio"]) for m in out if m["audio"] is not None) > max_audio_s * MODEL_RATE:
        raise _bad(f"input audio longer than {max_audio_s:.0f} s in all", "messages")
    if not out:
        raise _bad("no message carries text or audio", "messages")
    return out
