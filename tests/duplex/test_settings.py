"""Settings: command line over DUPLEX_* environment over preset file keys over defaults; bad
values rejected with a message naming the field."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from duplex.settings import load_preset
from harness.server import write_preset
from pipeline.config import ConfigError


def test_precedence_cli_env_file_default(tmp_path: Path) -> None:
    path = write_preset(tmp_path / "p.yaml", port=9001, max_sessions=3, host="127.0.0.2")
    preset = load_preset(["--config", str(path), "--port", "9003"],
                         environ={"DUPLEX_PORT": "9002", "DUPLEX_MAX_SESSIONS": "5"})
    s = preset.settings
    assert (s.port, s.max_sessions, s.host) == (9003, 5, "127.0.0.2")
    assert s.api_key is None and s.ice_server == [] and s.session.turn_detection.silence_duration_ms == 500
    assert preset.pipeline.model == "toy" and s.preset == "toy"


def test_lists_and_presets_by_name(tmp_path: Path) -> None:
    preset = load_preset(["--preset", "toy", "--ice-host", "127.0.0.1", "--ice-server", "stun:127.0.0.1:3478"],
                         environ={})
    assert preset.settings.ice_host == ["127.0.0.1"]
    assert preset.settings.ice_server == ["stun:127.0.0.1:3478"]
    env = load_preset([], environ={"DUPLEX_PRESET": "toy", "DUPLEX_ICE_HOST": "127.0.0.1,::1"})
    assert env.settings.ice_host == ["127.0.0.1", "::1"]


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"port": "eighty"}, "port"),
    ({"max_sessions": 0}, "max_sessions"),
    ({"session": {"turn_detection": {"threshold": 2}}}, "session.turn_detection"),
    ({"session": {"turn_detection": {"prefix_padding_ms": 10**9}}}, "prefix_padding_ms must be between"),
    ({"bogus_option": 1}, "bogus_option"),
    ({"pipeline": {"model": "toy", "entry": "nope", "stages": []}}, "pipeline"),
])
def test_bad_settings_name_the_field(tmp_path: Path, overrides: dict, needle: str) -> None:
    path = write_preset(tmp_path / "p.yaml", **overrides)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_preset(["--config", str(path)], environ={})


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="toy"):
        load_preset(["--preset", "no_such_preset"], environ={})


def test_a_preset_on_semantic_turns_without_their_model_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a fallback to server_vad: that would answer into every pause, the fault the default
    exists to prevent, with only a log line to tell. The message names the package to install."""

    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ConfigError, match=r"session\.turn_detection: .*pipecat-ai.*pip install"):
        load_preset(["--preset", "offline"], environ={})
    # Presets on server_vad need no end-of-turn model.
    assert load_preset(["--preset", "toy"], environ={}).settings.session.turn_detection.type == "server_vad"
