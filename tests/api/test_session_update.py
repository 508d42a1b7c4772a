"""``session.update`` and ``response.create`` as pure functions over a session's config: field by
field, each invalid field named, the beta names older clients send, OpenAI's voice names."""

from __future__ import annotations

import pytest

from duplex.protocol.events import RealtimeError
from duplex.protocol.fields import MAX_INSTRUCTIONS_CHARS
from duplex.protocol.response_create import response_spec
from duplex.protocol.session_update import apply_session_update, session_object
from duplex.session.config import SessionConfig
from duplex.settings import ServerSettings

VOICES = ["default", "ethan", "marin"]
CONFIG = SessionConfig(instructions="Be brief.", voice="default")


def test_valid_fields_apply_and_each_invalid_one_is_named() -> None:
    config, errors = apply_session_update(CONFIG, {
        "type": "realtime", "instructions": "Be kind.", "max_output_tokens": 5000, "bogus": 1,
        "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2.0}, "format": "pcm16"},
                  "output": {"voice": "marin", "speed": 0.5}, "other": {}},
        "tool_choice": {"type": "function", "name": "f"}}, VOICES)
    assert sorted(e.param for e in errors) == [
        "session.audio.input.turn_detection.threshold", "session.audio.other", "session.bogus",
        "session.max_output_tokens"]
    assert config.instructions == "Be kind." and config.voice == "marin" and config.speed == 0.5
    assert config.input_format == "audio/pcm" and config.tool_choice == {"type": "function", "name": "f"}
    assert config.turn_detection == CONFIG.turn_detection and config.max_output_tokens is None


def test_semantic_vad_and_back_keep_the_other_settings() -> None:
    semantic, errors = apply_session_update(CONFIG, {"audio": {"input": {"turn_detection": {
        "type": "semantic_vad", "eagerness": "low", "interrupt_response": False}}}}, VOICES)
    assert not errors
    td = semantic.turn_detection
    assert td is not None and (td.type, td.eagerness, td.interrupt_response) == ("semantic_vad", "low", False)
    wire = session_object("s", semantic, "m")["audio"]["input"]["turn_detection"]
    assert wire == {"type": "semantic_vad", "eagerness": "low", "create_response": True,
                    "interrupt_response": False}
    server, _ = apply_session_update(semantic, {"turn_detection": {"type": "server_vad",
                                                                    "silence_duration_ms": 700}}, VOICES)
    wire = session_object("s", server, "m")["audio"]["input"]["turn_detection"]
    assert wire["type"] == "server_vad" and wire["silence_duration_ms"] == 700 and "eagerness" not in wire
    _, errors = apply_session_update(CONFIG, {"turn_detection": {"type": "semantic_vad",
                                                                 "eagerness": "eager"}}, VOICES)
    assert [e.param for e in errors] == ["session.audio.input.turn_detection.eagerness"]


def test_beta_names_map_to_the_ga_fields_and_ga_wins() -> None:
    config, errors = apply_session_update(CONFIG, {
        "voice": "ethan", "input_audio_format": "audio/pcmu", "max_response_output_tokens": "inf",
        "audio": {"output": {"voice": "marin"}}}, VOICES)
    assert not errors
    assert (config.voice, config.input_format, config.max_output_tokens) == ("marin", "audio/pcmu", None)


def test_every_openai_voice_is_mapped_to_a_preset_voice() -> None:
    settings = ServerSettings.model_validate({"preset": "p", "voices": ["default", "ethan"],
                                              "voice_map": {"cedar": "ethan"}})
    mapped = settings.session.voice_map
    assert mapped["cedar"] == "ethan" and mapped["marin"] == "default" and len(mapped) == 10
    with pytest.raises(ValueError, match="voice_map"):
        ServerSettings.model_validate({"preset": "p", "voice_map": {"cedar": "nobody"}})


def test_response_create_over_the_session() -> None:
    session, _ = apply_session_update(CONFIG, {"tools": [{"type": "function", "name": "f"}]}, VOICES)
    spec = response_spec({"instructions": None, "metadata": {"client_event_id": "e1"}, "conversation": "none",
                          "max_output_tokens": "inf", "output_modalities": ["text"]}, session, VOICES)
    assert spec.instructions == "Be brief." and spec.metadata == {"client_event_id": "e1"}
    assert spec.out_of_band and spec.max_output_tokens is None and not spec.speaks
    assert spec.tools == session.tools and spec.voice == "default"
    for raw, param in [({"conversation": "other"}, "response.conversation"),
                       ({"metadata": {"k": 1}}, "response.metadata.k"),
                       ({"metadata": {str(i): "v" for i in range(17)}}, "response.metadata"),
                       ({"audio": {"output": {"voice": "nobody"}}}, "response.audio.output.voice"),
                       ({"colour": "blue"}, "response.colour")]:
        with pytest.raises(RealtimeError) as refused:
            response_spec(raw, session, VOICES)
        assert refused.value.param == param


def test_instructions_longer_than_the_limit_are_refused_and_the_rest_applies() -> None:
    long = "x" * (MAX_INSTRUCTIONS_CHARS + 1)
    config, errors = apply_session_update(CONFIG, {"instructions": long, "max_output_tokens": 7},
                                          VOICES)
    assert [e.param for e in errors] == ["session.instructions"]
    assert config.instructions == CONFIG.instructions and config.max_output_tokens == 7
    at_limit, errors = apply_session_update(CONFIG, {"instructions": long[1:]}, VOICES)
    assert not errors and at_limit.instructions == long[1:]
    with pytest.raises(RealtimeError) as refused:
        response_spec({"instructions": long}, CONFIG, VOICES)
    assert refused.value.param == "response.instructions"


def test_mcp_tools_name_only_the_servers_the_preset_lists() -> None:
    """Every way a session config is applied (session.update, a call's offer, a client secret)
    goes through apply_session_update: an MCP server the preset does not list is dropped with an
    error naming it, before anything could connect to it; the listed one and function tools stay."""
    tools = [{"type": "function", "name": "f"},
             {"type": "mcp", "server_label": "inside", "server_url": "http://169.254.169.254/mcp"},
             {"type": "mcp", "server_label": "docs", "server_url": "https://mcp.example.com/docs/mcp"}]
    config, errors = apply_session_update(CONFIG, {"tools": tools}, VOICES, ["https://mcp.example.com/docs"])
    assert [(e.code, e.param) for e in errors] == [("mcp_server_not_allowed", "session.tools[1].server_url")]
    assert [t.get("server_label", t.get("name")) for t in config.tools] == ["f", "docs"]
    config, errors = apply_session_update(CONFIG, {"tools": tools}, VOICES)  # none listed by default
    assert [e.param for e in errors] == ["session.tools[1].server_url", "session.tools[2].server_url"]
    assert [t["name"] for t in config.tools] == ["f"]
