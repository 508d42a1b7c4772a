"""The client events of the Realtime protocol, as one session takes them.

Each event is validated and dispatched to the Session; anything wrong (unknown type, missing or
bad fields, an action the session's state does not allow) becomes an ``error`` event that names
the problem, and the session goes on. A ClientEvents belongs to one transport binding; its only
state beyond its session is which of the history's items its client created (``conversation.item
.create``), so that those stay within the caps below, the decoder of the audio it appends (wire
format to the session's 16 kHz float32), and the connection's two audio budgets. It changes the
session only through the session's methods.

No client input holds the event loop long (DESIGN.md invariant 9): every piece of audio is counted
against its budget (and an item's against the caps) from its base64 length, before it is decoded;
anything longer than :data:`OFF_LOOP_MIN_S` is decoded off the loop (``duplex.media.offloop``);
a long append goes through the VAD in slices. Events stay in order: the binding hands over the
next event only once this one's handler, decode included, has returned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from duplex.media.offloop import off_loop
from duplex.protocol import images as image_input
from duplex.protocol.events import RealtimeError, error_event, event, new_id
from duplex.protocol.items import wire_item
from duplex.protocol.modalities import CODE, not_taken
from duplex.protocol.response_create import response_spec
from duplex.protocol.session_update import apply_session_update
from duplex.protocol.wire_audio import AudioFormatError, InboundDecoder, wire_seconds
from duplex.rate_limit import TokenBucket
from duplex.session.history import FunctionCall, Item
from duplex.session.session import Session
from duplex.tools.mcp_items import McpApprovalRequest, McpApprovalResponse, McpCall
from duplex.turns.vad import SAMPLE_RATE, WINDOW

MAX_TEXT_CHARS = 100_000
# Caps on what a client's own items (``conversation.item.create``) hold in the history at once; a
# deleted item (or one the history let go) frees its share. The history keeps 64 items: half of
# them for the client leaves the conversation's own turns room. Its audio is kept as 16 kHz float32
# (64 kB a second); 10 minutes of it, ~38 MB, is five times the longest user turn (120 s) and keeps
# eight sessions' client audio within ~300 MB. One message (16 MiB of base64) can carry ~4 minutes.
MAX_CLIENT_ITEMS = 32
HELD_BYTES_PER_S = SAMPLE_RATE * 4
MAX_CLIENT_AUDIO_BYTES = 600 * HELD_BYTES_PER_S
# Appended audio per connection, in seconds of audio a second: a client may upload faster than
# real time (a recorded file, a catch-up after a stall), but the VAD runs over every second it
# sends, on the event loop every session shares. 8x real time costs ~4 % of a core; the burst
# takes a whole longest turn (120 s) at once. An append beyond the budget is refused before it is
# decoded (its length says how much audio it holds).
AUDIO_RATE_S = 8.0
AUDIO_BURST_S = 120.0
# The audio of the client's own items (``conversation.item.create``, ``response.create``'s
# ``input``) per connection: no VAD runs over it, but each second is decoded and resampled, so it has
# a budget too, at the same rate. Its burst lets a client fill its share of the history
# (MAX_CLIENT_AUDIO_BYTES, 600 s) at once and replace a part of it; a client that creates and
# deletes two-minute items in a loop has the seventh refused, before it is decoded.
ITEM_AUDIO_RATE_S = AUDIO_RATE_S
ITEM_AUDIO_BURST_S = 1.25 * MAX_CLIENT_AUDIO_BYTES / HELD_BYTES_PER_S
# Images a connection may have decoded, a second: each is decoded off the loop, but one at the
# pixel cap costs ~0.1 s of a core, and a client that creates and deletes image items in a loop
# would keep decoding. The burst is a conversation's whole share of images at once.
IMAGE_RATE = 4.0
IMAGE_BURST = float(image_input.MAX_CONVERSATION_IMAGES)
# Audio shorter than this is decoded on the loop (~0.4 ms a second of 24 kHz pcm16): the hop to a
# thread and back would cost more than the work.
OFF_LOOP_MIN_S = 1.0
# A long append goes through the VAD this many samples at a time, the loop running other work in
# between: 8 windows (256 ms of audio) are ~2 ms of inference.
VAD_SLICE = 8 * WINDOW


def _field(message: dict[str, Any], name: str, kind: type, required: bool = True) -> Any:
    value = message.get(name)
    if value is None:
        if required:
            raise RealtimeError(f"missing required field {name!r}", code="missing_required_parameter", param=name)
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise RealtimeError(f"field {name!r} has the wrong type", code="invalid_type", param=name)
    return value


def client_event_id(message: Any) -> str | None:
    """The client's ``event_id``, to echo in an error: only a string (as the protocol has it)."""
    event_id = message.get("event_id") if isinstance(message, dict) else None
    return event_id if isinstance(event_id, str) else None


class AudioBudget:
    """Seconds of audio a second that one connection may send for one use (a TokenBucket); what
    goes beyond is refused with a ``rate_limited`` error that names the limits. Lives as long as
    the ClientEvents that owns it."""

    def __init__(self, what: str, rate_s: float, burst_s: float) -> None:
        self._what = what
        self._bucket = TokenBucket(rate_s, burst_s)

    def take(self, seconds: float, param: str) -> None:
        if not self._bucket.take(seconds):
            raise RealtimeError(
                f"more than {self._bucket.rate:.0f} s of {self._what} a second (bursts of "
                f"{self._bucket.burst:.0f} s): these {seconds:.1f} s were refused",
                code="rate_limited", param=param)


class ClientEvents:
    def __init__(self, session: Session) -> None:
        self.session = session
        self._created: set[str] = set()  # ids of the client's items, as long as the history has them
        self._decoder: InboundDecoder | None = None  # input_audio_buffer.append's stream
        self._audio_budget = AudioBudget("appended audio", AUDIO_RATE_S, AUDIO_BURST_S)
        self._item_budget = AudioBudget("item audio", ITEM_AUDIO_RATE_S, ITEM_AUDIO_BURST_S)
        self._image_budget = TokenBucket(IMAGE_RATE, IMAGE_BURST)

    async def handle(self, message: Any) -> bool:
        """One client event (parsed JSON); a bad one becomes an ``error`` event. False when it is
        no event of the protocol at all (not an object, no type, an unknown type)."""
        event_id = client_event_id(message)
        kind = message.get("type") if isinstance(message, dict) else None
        handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
        try:
            if not isinstance(message, dict):
                raise RealtimeError("an event must be a JSON object", code="invalid_event")
            if handler is None:
                raise RealtimeError(
                    f"unknown event type {kind!r}" if kind else "the event has no type",
                    code="unknown_event" if kind else "missing_required_parameter", param="type",
                )
            await handler(self, message)
        except AudioFormatError as err:
            self.session.send(error_event(str(err), "invalid_audio", "audio", event_id))
        except RealtimeError as err:
            self.session.send(error_event(err.message, err.code, err.param, event_id))
        return handler is not None

    # --- handlers ---------------------------------------------------------------------------

    async def _session_update(self, message: dict[str, Any]) -> None:
        session = self.session
        voices = [*session.voices, *session.defaults.voice_map]
        config, errors = apply_session_update(session.config, _field(message, "session", dict), voices,
                                              session.defaults.mcp_servers)
        session.reconfigure(config)
        for err in errors:
            session.log.info("session.update: %s refused: %s", err.param, err.message)
            session.send(error_event(err.message, err.code, err.param, client_event_id(message)))
        session.send(event("session.updated", session=session.session_object()))

    async def _append(self, message: dict[str, Any]) -> None:
        """Audio in the session's input format, within the connection's audio budget
        (:data:`AUDIO_RATE_S`), decoded off the loop when long; it goes through the VAD
        :data:`VAD_SLICE` samples at a time, yielding between slices, so one client's upload never
        stalls the event loop that paces everyone's audio."""
        b64 = _field(message, "audio", str)
        seconds = wire_seconds(self.session.config.input_format, b64)
        self._audio_budget.take(seconds, "audio")
        audio = await _decode(seconds, self._inbound().decode, b64)
        for start in range(0, len(audio), VAD_SLICE):
            self.session.on_audio(audio[start : start + VAD_SLICE])
            await asyncio.sleep(0)

    def _inbound(self) -> InboundDecoder:
        """The decoder of the appended stream, anew when ``session.update`` changed its format."""
        if self._decoder is None or self._decoder.format != self.session.config.input_format:
            self._decoder = InboundDecoder(self.session.config.input_format)
        return self._decoder

    async def _commit(self, message: dict[str, Any]) -> None:
        self.session.commit_input()

    async def _clear(self, message: dict[str, Any]) -> None:
        self.session.clear_manual_buffer()
        self.session.send(event("input_audio_buffer.cleared"))

    async def _item_create(self, message: dict[str, Any]) -> None:
        raw = _field(message, "item", dict)
        if raw.get("type") == "mcp_approval_response":
            self._approval(raw)
            return
        item, audio, images = self._item(raw, "item")
        seconds = self._seconds(audio)
        self._check_caps(seconds)
        self._check_images(images, "item.content")
        self._item_budget.take(seconds, "item.content")
        await self._decode_into(item, audio, seconds)
        await self._decode_images(item, images, "item.content")
        self.session.conversation.create(item)
        self._created.add(item.id)
        if isinstance(item.call, FunctionCall) and item.call.output is not None:
            self.session.call_wait.output_came(item.call.call_id)

    def _approval(self, raw: dict[str, Any]) -> None:
        """The client's answer to an ``mcp_approval_request``: added to the conversation, then
        answered by a response, which runs the approved call (its ``mcp_call`` item, then the model
        answers its output in a follow-up), or in which the model answers the denial."""
        session = self.session
        request_id = _field(raw, "approval_request_id", str)
        approve = raw.get("approve")
        if not isinstance(approve, bool):
            raise RealtimeError("item.approve must be true or false", code="invalid_type", param="item.approve")
        reason = _field(raw, "reason", str, required=False)
        request = session.history.get(request_id)
        asked = request.call if request is not None else None
        if request is None or not isinstance(asked, McpApprovalRequest):
            raise RealtimeError(f"no mcp_approval_request {request_id!r}", code="item_not_found",
                                param="item.approval_request_id")
        if asked.approved is not None:
            raise RealtimeError(f"the approval request {request_id!r} was answered already",
                                param="item.approval_request_id")
        if session.response is not None:
            raise RealtimeError("a response is in progress: answer the approval request once it is done",
                                code="conversation_already_has_active_response")
        item_id = raw.get("id") if isinstance(raw.get("id"), str) else new_id("item")
        answer = McpApprovalResponse(asked.call_id, asked.name, approval_request_id=request_id,
                                     approve=approve, reason=reason)
        session.conversation.create(Item(item_id, "user", call=answer))
        asked.approved = approve
        session.log.info("MCP call %s of %s %s by the client", asked.name, asked.server_label,
                         "approved" if approve else "denied")
        if approve:
            call = McpCall(new_id("call"), asked.name, asked.arguments, server_label=asked.server_label,
                           approval_request_id=request_id)
            session.mcp.approve(Item(new_id("item"), "assistant", call=call))
            # The response runs the call and asks the model nothing (an empty input: no request
            # reaches the pipeline); the follow-up answers the call's output.
            session.start_response(input_items=[])
        else:
            session.start_response()

    def _seconds(self, audio: Sequence[str]) -> float:
        """How much audio base64 parts in the session's input format hold, before decoding."""
        return sum(wire_seconds(self.session.config.input_format, part) for part in audio)

    async def _decode_into(self, item: Item, audio: Sequence[str], seconds: float) -> None:
        """Give ``item`` the audio of its base64 parts (off the loop when long)."""
        if not audio:
            return
        item.audio = await _decode(seconds, _decode_parts, self.session.config.input_format, audio)
        item.sample_rate = SAMPLE_RATE

    def _check_images(self, images: Sequence[image_input.EncodedImage], param: str,
                      held: int = 0) -> None:
        """Refuse images beyond the per-item cap, the per-conversation cap (``held`` more besides
        the history's) and the connection's image budget, before any is decoded."""
        if len(images) > image_input.MAX_IMAGES_PER_ITEM:
            raise RealtimeError(f"an item holds at most {image_input.MAX_IMAGES_PER_ITEM} images",
                                code="item_limit_exceeded", param=param)
        held += sum(len(i.images) for i in self.session.history.items)
        if images and held + len(images) > image_input.MAX_CONVERSATION_IMAGES:
            raise RealtimeError(
                f"the conversation would hold {held + len(images)} images, over the cap "
                f"(MAX_CONVERSATION_IMAGES = {image_input.MAX_CONVERSATION_IMAGES}); delete some first",
                code="item_limit_exceeded", param=param)
        if images and not self._image_budget.take(len(images)):
            raise RealtimeError(
                f"more than {IMAGE_RATE:g} images a second (bursts of {IMAGE_BURST:g}): these "
                f"{len(images)} were refused", code="rate_limited", param=param)

    async def _decode_images(self, item: Item, images: Sequence[image_input.EncodedImage], param: str) -> None:
        """Give ``item`` its images, decoded off the loop (every image is: a PNG's inflate or a
        JPEG's decode of a few megapixels takes tens of milliseconds)."""
        if not images:
            return
        try:
            item.images = await off_loop(image_input.decode_all, list(images))
        except image_input.ImageError as err:
            raise RealtimeError(str(err), code="invalid_image", param=param) from None

    def _check_caps(self, seconds: float) -> None:
        """Refuse a new item beyond :data:`MAX_CLIENT_ITEMS`, or one whose ``seconds`` of audio
        would pass :data:`MAX_CLIENT_AUDIO_BYTES` (before it is decoded)."""
        held = [i for i in self.session.history.items if i.id in self._created]
        self._created = {i.id for i in held}
        if len(held) >= MAX_CLIENT_ITEMS:
            raise RealtimeError(
                f"the conversation already holds {len(held)} items created by the client, the cap "
                f"(MAX_CLIENT_ITEMS = {MAX_CLIENT_ITEMS}); delete some first",
                code="item_limit_exceeded", param="item")
        held_bytes = sum(i.audio.nbytes for i in held if i.audio is not None)
        new_bytes = round(seconds * HELD_BYTES_PER_S)
        if held_bytes + new_bytes > MAX_CLIENT_AUDIO_BYTES:
            raise RealtimeError(
                f"the client's items would hold {held_bytes + new_bytes} bytes of audio (16 kHz "
                f"float32), over the cap (MAX_CLIENT_AUDIO_BYTES = {MAX_CLIENT_AUDIO_BYTES}); "
                "delete some first", code="item_limit_exceeded", param="item.content")

    def _item(self, raw: dict[str, Any], param: str
              ) -> tuple[Item, list[str], list[image_input.EncodedImage]]:
        """A client's item (``conversation.item.create``, ``response.input``): a message, a function
        call's output, or a function call (a past one, as some clients replay their history); and
        its audio parts, base64 in the session's input format, and its images (data URLs, on
        presets that see), still to be decoded (each audio part a stream of its own) once they fit
        the budget and the caps."""
        kind = raw.get("type", "message")
        item_id = raw.get("id") if isinstance(raw.get("id"), str) else new_id("item")
        if kind in ("function_call", "function_call_output"):
            return Item(item_id, "assistant" if kind == "function_call" else "user",
                        call=self._call(raw, kind, param)), [], []
        if kind != "message":
            where = " (only conversation.item.create takes an mcp_approval_response)" \
                if kind == "mcp_approval_response" else ""
            raise RealtimeError(f"item type {kind!r} is not supported{where}", param=f"{param}.type")
        role = raw.get("role")
        if role not in ("user", "assistant", "system"):
            raise RealtimeError(f"{param}.role must be user, assistant or system", param=f"{param}.role")
        content = raw.get("content")
        if not isinstance(content, list) or not content:
            raise RealtimeError(f"{param}.content must be a non-empty list", param=f"{param}.content")
        texts: list[str] = []
        audio: list[str] = []
        images: list[image_input.EncodedImage] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "text", "output_text"):
                texts.append(_field(part, "text", str))
            elif kind == "input_audio" and role == "user":
                audio.append(_field(part, "audio", str))
            elif kind == "input_image" and "image" not in self.session.pipeline.input_modalities:
                raise RealtimeError(not_taken("image", self.session.pipeline.input_modalities),
                                    code=CODE, param=f"{param}.content")
            elif kind == "input_image" and role == "user":
                try:
                    images.append(image_input.parse_data_url(part.get("image_url")))
                except image_input.ImageError as err:
                    raise RealtimeError(str(err), code="invalid_image",
                                        param=f"{param}.content.image_url") from None
            else:
                raise RealtimeError(f"content type {kind!r} is not supported for {role}",
                                    param=f"{param}.content.type")
        text = "".join(texts) or None
        if text is not None and len(text) > MAX_TEXT_CHARS:
            raise RealtimeError(f"text longer than {MAX_TEXT_CHARS} characters", param=f"{param}.content")
        return Item(item_id, role, text=text), audio, images

    def _call(self, raw: dict[str, Any], kind: str, param: str) -> FunctionCall:
        call_id = _field(raw, "call_id", str)
        if kind == "function_call":
            return FunctionCall(call_id, _field(raw, "name", str), raw.get("arguments") or "")
        output = _field(raw, "output", str)
        if len(output) > MAX_TEXT_CHARS:
            raise RealtimeError(f"output longer than {MAX_TEXT_CHARS} characters", param=f"{param}.output")
        # The call it answers names the function for the model (when it is still in the history).
        name = next((i.call.name for i in self.session.history.items
                     if i.call is not None and i.call.call_id == call_id), "")
        return FunctionCall(call_id, name, output=output)

    def _input_item(self, raw: dict[str, Any], param: str
                    ) -> tuple[Item, list[str], list[image_input.EncodedImage]]:
        """An item of ``response.input`` and its audio and images still to decode (as
        :meth:`_item`): a message, or a reference to an item of the history."""
        if raw.get("type") != "item_reference":
            return self._item(raw, param)
        item = self.session.history.get(raw.get("id"))  # type: ignore[arg-type]
        if item is None:
            raise RealtimeError(f"no item {raw.get('id')!r}", code="item_not_found", param=f"{param}.id")
        return item, [], []

    async def _item_retrieve(self, message: dict[str, Any]) -> None:
        item_id = _field(message, "item_id", str)
        item = self.session.history.get(item_id)
        if item is None:  # OpenAI's code, which clients (pipecat) match on
            raise RealtimeError(f"no item {item_id!r}", code="item_retrieve_invalid_item_id", param="item_id")
        self.session.send(event("conversation.item.retrieved", item=wire_item(item)))

    async def _item_truncate(self, message: dict[str, Any]) -> None:
        item_id = _field(message, "item_id", str)
        audio_end_ms = _field(message, "audio_end_ms", int)
        item = self.session.history.get(item_id)
        if item is None or item.role != "assistant":
            raise RealtimeError(f"no assistant item {item_id!r}", code="item_not_found", param="item_id")
        if audio_end_ms < 0:
            raise RealtimeError("audio_end_ms must not be negative", param="audio_end_ms")
        await self.session.truncate_heard(item, audio_end_ms)

    async def _item_delete(self, message: dict[str, Any]) -> None:
        self.session.conversation.delete(_field(message, "item_id", str))

    async def _response_create(self, message: dict[str, Any]) -> None:
        session = self.session
        raw = _field(message, "response", dict, required=False) or {}
        spec = response_spec(raw, session.config, [*session.voices, *session.defaults.voice_map])
        items = None
        if spec.input is not None:
            given = [self._input_item(item, f"response.input[{i}]") for i, item in enumerate(spec.input)]
            seconds = [self._seconds(audio) for _, audio, _ in given]
            for i, (_, _, images) in enumerate(given):
                self._check_images(images, "response.input", sum(len(g[2]) for g in given[:i]))
            self._item_budget.take(sum(seconds), "response.input")
            for (item, audio, images), item_seconds in zip(given, seconds, strict=True):
                await self._decode_into(item, audio, item_seconds)
                await self._decode_images(item, images, "response.input")
            items = [item for item, _, _ in given]
        session.start_response(spec=spec, input_items=items)

    async def _response_cancel(self, message: dict[str, Any]) -> None:
        response_id = _field(message, "response_id", str, required=False)
        if not await self.session.cancel_response("client_cancelled", response_id):
            raise RealtimeError("there is no response in progress" if response_id is None
                                else f"no response {response_id!r} in progress",
                                code="response_cancel_not_active")

    async def _output_clear(self, message: dict[str, Any]) -> None:
        self.session.audio.clear()
        await self.session.cancel_response("client_cancelled")


async def _decode(seconds: float, decode: Callable[..., np.ndarray], *args: Any) -> np.ndarray:
    """``decode(*args)``, of ``seconds`` of audio: on the loop when short (:data:`OFF_LOOP_MIN_S`),
    else on the off-loop pool."""
    return decode(*args) if seconds < OFF_LOOP_MIN_S else await off_loop(decode, *args)


def _decode_parts(fmt: str, audio: Sequence[str]) -> np.ndarray:
    """An item's base64 audio parts in ``fmt``, each a stream of its own, as one 16 kHz float32
    array (on any thread: every part gets its own decoder)."""
    return np.concatenate([InboundDecoder(fmt, SAMPLE_RATE).decode(part) for part in audio])


# Each client event type and the ClientEvents method that handles it, as plain functions: bound
# methods kept per instance would make every ClientEvents a reference cycle, which keeps its
# session (and the session's resamplers) alive after the session closed, until Python's cyclic
# garbage collector runs.
_HANDLERS: dict[str, Callable[[ClientEvents, dict[str, Any]], Awaitable[None]]] = {
    "session.update": ClientEvents._session_update,
    "input_audio_buffer.append": ClientEvents._append,
    "input_audio_buffer.commit": ClientEvents._commit,
    "input_audio_buffer.clear": ClientEvents._clear,
    "conversation.item.create": ClientEvents._item_create,
    "conversation.item.truncate": ClientEvents._item_truncate,
    "conversation.item.delete": ClientEvents._item_delete,
    "conversation.item.retrieve": ClientEvents._item_retrieve,
    "response.create": ClientEvents._response_create,
    "response.cancel": ClientEvents._response_cancel,
    "output_audio_buffer.clear": ClientEvents._output_clear,
}
