"""Property-based fuzzing (hypothesis) of ``session.update`` and of arbitrary client events over the
real WebSocket: whatever a client sends, the server answers with events that validate against the
``openai`` package's GA types, a malformed event gets an ``error`` naming the problem (the field
that is missing, the unknown type, ...) and carrying the event's id, no handler fails
(``server_error``), and the session keeps answering: after every example a probe event is
answered, and after the run a whole response completes.

The server is this module's own, with three-word answers, so that the valid ``response.create``
the fuzzer sends now and then is over in a moment."""

from __future__ import annotations

import base64
import itertools
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from websockets.sync.client import ClientConnection, connect

from duplex.protocol.session_update import AUDIO_FORMATS
from duplex.protocol.voices import OPENAI_VOICES
from harness.server import ServerProcess, run_server, write_preset
from tests.api.helpers import TIMEOUT, toy_pipeline, user_text
from tests.api.test_realtime_schema import SERVER_EVENTS

log = logging.getLogger(__name__)

# ~10 s a test on 2 cores; derandomized so that CI runs the same examples every time.
EXAMPLES = settings(max_examples=150, deadline=None, derandomize=True)
PROBE = "conversation.item.retrieve"  # always answered: an error for an item that is not there
# Each known event type and the field it cannot do without.
REQUIRED = {"session.update": "session", "input_audio_buffer.append": "audio",
            "conversation.item.create": "item", "conversation.item.retrieve": "item_id",
            "conversation.item.delete": "item_id", "conversation.item.truncate": "item_id"}
TYPES = [*REQUIRED, "input_audio_buffer.commit", "input_audio_buffer.clear", "response.create",
         "response.cancel", "output_audio_buffer.clear"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("fuzz")
    pipeline = toy_pipeline(thinker={"options": {"answer_tokens": 3}})
    with run_server(write_preset(tmp / "preset.yaml", pipeline=pipeline), tmp=tmp) as running:
        yield running


# --- what the fuzzer sends ----------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly well-typed values, sometimes any JSON at all."""
    return strategy | json_values


def optional_fields(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


audio_format = maybe(st.sampled_from([*AUDIO_FORMATS, "pcm16", "audio/opus"])
                     | st.builds(lambda kind, rate: {"type": kind, "rate": rate},
                                 st.sampled_from(sorted(AUDIO_FORMATS)), st.integers(0, 96000)))
turn_detection = st.none() | optional_fields(
    type=maybe(st.sampled_from(["server_vad", "semantic_vad", "magic_vad"])),
    threshold=maybe(st.floats()), prefix_padding_ms=maybe(st.integers()),
    silence_duration_ms=maybe(st.integers()), create_response=maybe(st.booleans()),
    interrupt_response=maybe(st.booleans()), eagerness=maybe(st.sampled_from(["low", "high", "eager"])))
tool = optional_fields(type=maybe(st.just("function")), name=maybe(st.text(max_size=10)),
                       parameters=json_values)
session_fields = optional_fields(
    type=maybe(st.sampled_from(["realtime", "transcription"])), instructions=maybe(st.text(max_size=40)),
    voice=maybe(st.sampled_from(OPENAI_VOICES)), max_output_tokens=maybe(st.integers() | st.just("inf")),
    output_modalities=maybe(st.lists(st.sampled_from(["audio", "text", "video"]), max_size=3)),
    tools=maybe(st.lists(tool, max_size=2)), tool_choice=maybe(st.sampled_from(["auto", "none", "required"])),
    audio=maybe(optional_fields(
        input=maybe(optional_fields(format=audio_format, turn_detection=maybe(turn_detection),
                                    transcription=maybe(optional_fields(model=maybe(st.text(max_size=8)))))),
        output=maybe(optional_fields(voice=maybe(st.sampled_from(OPENAI_VOICES)),
                                     speed=maybe(st.floats()), format=audio_format)))),
    no_such_field=json_values)
sessions = maybe(session_fields)

audio_b64 = st.binary(max_size=960).map(lambda raw: base64.b64encode(raw).decode("ascii"))
content_part = optional_fields(type=maybe(st.sampled_from(["input_text", "input_audio", "output_text", "image"])),
                               text=maybe(st.text(max_size=20)), audio=maybe(audio_b64))
items = maybe(optional_fields(
    id=maybe(st.text(max_size=12)), role=maybe(st.sampled_from(["user", "assistant", "system", "tool"])),
    type=maybe(st.sampled_from(["message", "function_call", "function_call_output", "item_reference"])),
    content=maybe(st.lists(content_part, max_size=3)) | st.just([user_text("hi")["content"][0]]),
    call_id=maybe(st.text(max_size=8)), name=maybe(st.text(max_size=8)), output=maybe(st.text(max_size=20))))
responses = maybe(optional_fields(
    conversation=maybe(st.just("none")), max_output_tokens=maybe(st.integers(1, 3)),
    output_modalities=maybe(st.lists(st.sampled_from(["audio", "text"]), max_size=2)),
    instructions=maybe(st.text(max_size=20)), metadata=json_values, input=maybe(st.lists(items, max_size=2))))
events = st.fixed_dictionaries(
    {"type": maybe(st.sampled_from(TYPES)) | st.text(max_size=24)},
    optional={"event_id": maybe(st.text(min_size=1, max_size=16)), "session": sessions, "audio": maybe(audio_b64),
              "item": items, "item_id": maybe(st.text(max_size=12)), "audio_end_ms": maybe(st.integers()),
              "content_index": maybe(st.integers()), "response": responses})
messages = events.map(json.dumps) | json_values.map(json.dumps) | st.text(max_size=40)


# --- the client ---------------------------------------------------------------------------------

class FuzzClient:
    """One WebSocket session: sends a message, then a probe, and returns what came in between."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self._probes = itertools.count()

    def recv(self) -> dict[str, Any]:
        event: dict[str, Any] = json.loads(self.ws.recv(timeout=TIMEOUT))
        return event

    def exchange(self, message: str) -> list[dict[str, Any]]:
        """Send ``message``; the events that came before the probe after it was answered, all
        read before any is checked (a failed example leaves no reply behind for the next)."""
        probe = f"probe-{next(self._probes)}"
        self.ws.send(message)
        self.ws.send(json.dumps({"type": PROBE, "item_id": "no-such-item", "event_id": probe}))
        replies: list[dict[str, Any]] = []
        while (event := self.recv()).get("error", {}).get("event_id") != probe:
            replies.append(event)
        for reply in [*replies, event]:
            check_valid(reply)
        return replies

    def finishes_a_response(self) -> None:
        """The session still works: a response of its own, after any the fuzzer left running."""
        self.exchange(json.dumps({"type": "response.cancel"}))
        self.ws.send(json.dumps({"type": "conversation.item.create", "item": user_text("Still there?")}))
        self.ws.send(json.dumps({"type": "response.create", "response": {
            "output_modalities": ["text"], "max_output_tokens": 3, "conversation": "none"}}))
        while (event := self.recv())["type"] != "response.done":
            check_valid(event)
            assert event["type"] != "error", event
        assert event["response"]["status"] == "completed", event


def check_valid(event: dict[str, Any]) -> None:
    model = SERVER_EVENTS.get(event["type"])
    assert model is not None, f"{event['type']} is no GA server event"
    try:
        model.model_validate(event)
    except ValidationError as err:
        raise AssertionError(f"{err}\n{json.dumps(event)[:1500]}") from None
    if event["type"] == "error":
        error = event["error"]
        assert error["message"] and error["code"] and error["code"] != "server_error", event


@pytest.fixture
def client(server: ServerProcess) -> Iterator[FuzzClient]:
    url = server.url.replace("http", "ws", 1) + "/v1/realtime?model=gpt-realtime"
    with connect(url, max_size=None) as ws:
        fuzz = FuzzClient(ws)
        assert fuzz.recv()["type"] == "session.created"
        yield fuzz


def errors(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["error"] for e in replies if e["type"] == "error"]


def test_session_update_applies_valid_fields_and_names_each_bad_one(client: FuzzClient) -> None:
    @EXAMPLES
    @given(session=sessions)
    def update(session: Any) -> None:
        replies = client.exchange(json.dumps({"type": "session.update", "session": session,
                                              "event_id": "fuzz"}))
        refused = errors(replies)
        assert all(e["event_id"] == "fuzz" for e in refused), refused
        updated = [e for e in replies if e["type"] == "session.updated"]
        if isinstance(session, dict):  # field by field: the valid ones apply, each bad one is named
            assert len(updated) == 1, replies
            assert all(e["param"] and e["param"].startswith("session.") for e in refused), refused
        else:
            assert not updated and [e["param"] for e in refused] == ["session"], replies

    update()
    client.finishes_a_response()


def test_any_client_message_is_answered_or_refused_by_name(client: FuzzClient) -> None:
    @EXAMPLES
    @given(message=messages)
    def send(message: str) -> None:
        replies = client.exchange(message)
        refused = errors(replies)
        try:
            event = json.loads(message)
        except ValueError:
            assert [e["code"] for e in refused] == ["invalid_json"], replies
            return
        if not isinstance(event, dict):
            assert [e["code"] for e in refused] == ["invalid_event"], replies
            return
        event_id = event.get("event_id")
        assert all(e["event_id"] == (event_id if isinstance(event_id, str) else None)
                   for e in refused), refused
        kind = event.get("type")
        if kind not in TYPES:
            assert [(e["code"], e["param"]) for e in refused] in (
                [("unknown_event", "type")], [("missing_required_parameter", "type")]), replies
        elif kind in REQUIRED and event.get(REQUIRED[kind]) is None:
            assert [e["param"] for e in refused] == [REQUIRED[kind]], replies

    send()
    client.finishes_a_response()
