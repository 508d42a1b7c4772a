"""Server settings: command line, ``DUPLEX_<OPTION>`` environment variables and preset file keys.

Precedence, highest first: command line, environment, the preset file, defaults. One preset file
holds both the server settings (top-level keys named like the options, plus a ``session`` section of
turn-taking defaults) and the ``pipeline`` section (``pipeline.config``). Settings are immutable and
live as long as the server.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from duplex.media.video_window import VideoInput
from duplex.protocol.voices import OPENAI_VOICES
from duplex.session.config import SessionConfig
from duplex.turns.config import TurnDetection
from duplex.turns.end_of_turn import ModelNotInstalled, require_model
from pipeline.config import ConfigError, PipelineConfig, parse_pipeline_config, read_yaml

CONFIGS_DIR = Path(__file__).parent / "presets"  # the repository's configs/, linked (package data)


class SessionDefaults(BaseModel):
    """Turn-taking defaults of every new session (CONTRACT.md); clients change them per session."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instructions: str = "You are a helpful voice assistant. Answer briefly."
    voice: str = "default"
    turn_detection: TurnDetection = Field(default_factory=TurnDetection)
    interrupt_min_speech_ms: int = Field(default=200, ge=0)
    echo_guard_threshold: float = Field(default=0.7, gt=0, lt=1)
    echo_guard_ms: int = Field(default=1000, ge=0)
    inbound_media_timeout_s: float = Field(default=10.0, gt=0)
    max_input_audio_s: float = Field(default=120.0, gt=0)
    max_output_tokens: int | None = Field(default=None, ge=1)
    # The model keeps each conversation's state between turns (the pipeline's conversation_id), so
    # a turn computes only what is new; for presets whose model offers it (qwen3_omni).
    keep_model_state: bool = False
    # With keep_model_state: while the user speaks, each piece of this many seconds of their turn
    # is encoded and prefilled into the kept state (duplex/session/prefill.py), so the turn's end
    # leaves only its last piece to do; 0: off. Pieces of 8 s (the audio tower's attention block)
    # encode exactly as the whole turn would; shorter ones are measured in the README.
    prefill_piece_s: int = Field(default=0, ge=0, le=60)
    # semantic_vad begins the answer at each pause and drops it when the user goes on
    # (duplex/session/speculation.py): faster answers for the CPU of the answers dropped.
    speculative_start: bool = True
    # Speech over the agent shorter than this is recognised before it interrupts, and a
    # backchannel ("mhm", "yeah") lets the agent go on (duplex/session/barge_in.py); 0: off, every
    # speech of interrupt_min_speech_ms interrupts. For presets whose pipeline transcribes.
    backchannel_max_ms: int = Field(default=0, ge=0, le=3000)
    # Client voice names (OpenAI's) → the preset's voices; the preset file's top-level
    # ``voice_map`` (see ServerSettings), every OpenAI voice it leaves out speaking as its first voice.
    voice_map: dict[str, str] = Field(default_factory=dict)
    # Operators' call limits (duplex/session/idle.py). The caller silent for
    # turn_detection.idle_timeout_ms after the agent's audio: with check_ins > 0 the agent asks
    # check_in_text, and after check_ins check-ins without an answer says idle_goodbye_text and
    # hangs up (0: every timeout just answers, as OpenAI's idle_timeout_ms does).
    check_ins: int = Field(default=0, ge=0, le=10)
    check_in_text: str = Field(default="Are you still there?", min_length=1, max_length=500)
    idle_goodbye_text: str = Field(default="I haven't heard from you, so I'll hang up now. Goodbye.",
                                   min_length=1, max_length=500)
    # A call longer than this (seconds since it began) hears closing_text and is hung up; None: no
    # limit. A call's own limit (Session.idle.limit_call) may only shorten it.
    max_call_s: float | None = Field(default=None, gt=0)
    closing_text: str = Field(default="We have reached the time limit for this call. Thank you, goodbye.",
                              min_length=1, max_length=500)

    # A client's function call whose output has not come call_filler_after_ms (of the caller's
    # audio) after its response ended: the agent says call_filler_text, once per wait
    # (duplex/session/call_wait.py); None: the wait is silent, as OpenAI's.
    call_filler_text: str | None = Field(default=None, min_length=1, max_length=500)
    call_filler_after_ms: int = Field(default=1500, ge=100, le=30000)

    # A WebRTC call's camera or screen share, on presets whose model sees: how it is sampled and
    # kept (duplex/media/video_window.py).
    video: VideoInput = Field(default_factory=VideoInput)

    # The MCP servers a session's tools may name (duplex/tools/mcp_spec.py ``allowed``): URLs whose
    # scheme, host and port a server's must match and whose path it must be under, or "*" (any).
    # None by default: a client could otherwise make the server reach any address it can.
    mcp_servers: tuple[str, ...] = ()

    # A Realtime WebSocket session whose connection dropped waits this long (seconds) for its
    # client to resume it with the token of its session.created (docs/resume.md), holding its
    # slot; 0: a dropped connection ends its session at once.
    resume_grace_s: float = Field(default=30.0, ge=0, le=600)

    # Cancel the agent's own echo from the caller's audio (duplex/media/front_end.py). None: on
    # for SIP, Twilio and the WebSocket, off for WebRTC, whose browsers cancel it themselves (and
    # where the server's canceller, measured, slowed turn decisions: docs/audio_processing.md);
    # ``--[no-]echo-cancellation`` sets it for every transport, a session's
    # ``audio.input.echo_cancellation`` for itself.
    echo_cancellation: bool | None = None
    # Each session records what its audio front end took and gave (before and after echo
    # cancellation and noise suppression) in this folder (duplex/media/front_end_recording.py),
    # for operators debugging a call; None (the default): nothing. ``--front-end-record-dir``.
    front_end_record_dir: str | None = None

    def session_config(self, transport: str | None = None) -> SessionConfig:
        """A new session's settings on ``transport`` (its kind: "webrtc", "sip", ...), before
        any ``session.update``."""
        echo = self.echo_cancellation
        return SessionConfig(instructions=self.instructions, voice=self.voice,
                             max_output_tokens=self.max_output_tokens,
                             turn_detection=self.turn_detection,
                             echo_cancellation=transport != "webrtc" if echo is None else echo)


class TransferTarget(BaseModel):
    """One place the ``transfer_call`` tool may send a SIP call: the model names it, never its URI."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str = Field(max_length=1024, description="a sip:, sips: or tel: URI (the REFER's Refer-To)")
    description: str | None = Field(default=None, max_length=500,
                                    description="who answers there, for the model to choose by")

    @model_validator(mode="before")
    @classmethod
    def _uri_alone(cls, data: Any) -> Any:
        """``desk: sip:desk@pbx.example`` is short for ``desk: {uri: sip:desk@pbx.example}``."""
        return {"uri": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _referable(self) -> TransferTarget:
        from duplex.transports.sip.refer import valid_target  # the same check /refer makes

        if not valid_target(self.uri):
            raise ValueError(f"{self.uri!r} is not a sip:, sips: or tel: URI a REFER can name")
        return self


class TransferCallSettings(BaseModel):
    """The built-in ``transfer_call`` tool (duplex/tools/transfer_call.py), the preset's
    ``transfer_call:`` section: when enabled, the model of a SIP call is offered it beside the
    client's tools and may hand the call on to one of ``targets`` (a REFER, as ``/refer`` sends)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    targets: dict[str, TransferTarget] = Field(default_factory=dict, max_length=32)

    @model_validator(mode="after")
    def _targets_named(self) -> TransferCallSettings:
        bad = [name for name in self.targets if not (
            0 < len(name) <= 64 and name.isascii() and name.replace("_", "a").replace("-", "a").isalnum())]
        if bad:
            raise ValueError(f"target names are 1-64 letters, digits, '_' or '-': {bad}")
        if self.enabled and not self.targets:
            raise ValueError("transfer_call.enabled needs at least one target")
        return self


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @property
    def rtp_port_range(self) -> tuple[int, int]:
        low, high = (int(p) for p in self.rtp_ports.split("-"))
        return low, high

    preset: str
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: str | None = Field(default=None, repr=False)
    # Twilio's account auth token: Twilio's request signature (X-Twilio-Signature) is checked on
    # the voice webhook and on the media stream's handshake (duplex/api/twilio.py).
    twilio_auth_token: str | None = Field(default=None, repr=False)
    # Proxies whose X-Forwarded-For / Forwarded headers name the client address that per-address
    # limits use (uvicorn's meaning: comma-separated addresses or networks, "*" for any).
    forwarded_allow_ips: str | None = None
    # Host names (the Host header) the server answers besides loopback names and --host: a page
    # whose name was rebound to this server's address sends its own name and is refused.
    allowed_host: list[str] = Field(default_factory=list)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ice_server: list[str] = Field(default_factory=list)
    ice_host: list[str] = Field(default_factory=list)
    sip_port: int | None = Field(default=None, ge=0, le=65535)
    sip_allow: list[str] = Field(default_factory=list, description="CIDRs; empty: loopback only")
    sip_advertise: str | None = Field(default=None, description="address in SIP Contact and SDP")
    rtp_ports: str = Field(default="40000-40999", pattern=r"^\d{1,5}-\d{1,5}$")
    max_sessions: int = Field(default=8, ge=1)
    # One stereo WAV and one JSON-lines log per call in this folder (duplex/media/recording.py);
    # None: nothing is recorded.
    record_dir: str | None = None
    # Incoming SIP calls ring while this URL is asked (a signed realtime.call.incoming POST,
    # duplex/transports/sip/webhook.py) and the app accepts or rejects them through the call API;
    # None: calls are answered at once. The secret signs the POSTs (required with a URL).
    call_webhook: str | None = Field(default=None, pattern=r"^https?://\S+$")
    call_webhook_secret: str | None = Field(default=None, repr=False, min_length=1)
    # Seconds a ringing call waits for /accept or /reject before it is refused with 480. Below
    # 64*T1 (32 s), when the caller's INVITE transaction gives up.
    call_decision_timeout_s: float = Field(default=10.0, gt=0, le=30)
    # The built-in transfer_call tool that SIP calls' models are offered, and where it may send
    # a call (TransferCallSettings); off by default.
    transfer_call: TransferCallSettings = Field(default_factory=TransferCallSettings)
    pipeline_mode: Literal["process", "inproc"] = "process"
    voices: list[str] = Field(default_factory=lambda: ["default"])
    session: SessionDefaults = Field(default_factory=SessionDefaults)

    @model_validator(mode="after")
    def _webhook_is_signed(self) -> ServerSettings:
        if self.call_webhook and not self.call_webhook_secret:
            raise ValueError("call_webhook needs call_webhook_secret: the app must be able to tell "
                             "the server's calls from forged ones")
        return self

    @model_validator(mode="before")
    @classmethod
    def _session_options(cls, data: Any) -> Any:
        """``--[no-]echo-cancellation`` and ``--front-end-record-dir`` (server options) are the
        sessions' defaults."""
        for name in ("echo_cancellation", "front_end_record_dir"):
            if isinstance(data, dict) and name in data:
                data = dict(data)
                session = data.get("session") or {}
                if isinstance(session, dict):
                    data["session"] = {**session, name: data.pop(name)}
        return data

    @model_validator(mode="before")
    @classmethod
    def _voice_map(cls, data: Any) -> Any:
        """The file's top-level ``voice_map`` becomes the sessions' ``session.voice_map``: every
        OpenAI voice name maps to one of ``voices`` (the first unless the file says otherwise)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        voices = data.get("voices") or ["default"]
        given = data.pop("voice_map", None) or {}
        if not isinstance(given, dict):
            raise ValueError("voice_map must map client voice names to voices of the preset")
        unknown = {name: v for name, v in given.items() if v not in voices}
        if unknown:
            raise ValueError(f"voice_map: {unknown} name voices the preset lacks (voices: {voices})")
        session = data.get("session") or {}
        if isinstance(session, dict):
            data["session"] = {**session, "voice_map": {**{v: voices[0] for v in OPENAI_VOICES}, **given}}
        return data


@dataclass(frozen=True)
class Preset:
    settings: ServerSettings
    pipeline: PipelineConfig
    description: str


_OPTIONS: dict[str, dict[str, Any]] = {
    "host": {},
    "port": {"type": int},
    "api_key": {},
    "twilio_auth_token": {},
    "forwarded_allow_ips": {},
    "allowed_host": {"nargs": "+", "action": "extend"},
    "ssl_certfile": {},
    "ssl_keyfile": {},
    "ice_server": {"nargs": "+", "action": "extend"},
    "ice_host": {"nargs": "+", "action": "extend"},
    "sip_port": {"type": int},
    "sip_allow": {"nargs": "+", "action": "extend"},
    "sip_advertise": {},
    "rtp_ports": {},
    "max_sessions": {"type": int},
    "record_dir": {},
    "call_webhook": {},
    "call_webhook_secret": {},
    "call_decision_timeout_s": {"type": float},
    "pipeline_mode": {"choices": ["process", "inproc"]},
    "echo_cancellation": {"action": argparse.BooleanOptionalAction},
    "front_end_record_dir": {},
}


def default_preset() -> str:
    """One that converses on this machine: Qwen3-Omni where CUDA is available, the offline CPU
    model set (speech recognition, a small language model, speech synthesis) elsewhere."""
    import torch

    return "qwen3_omni" if torch.cuda.is_available() else "offline"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m duplex.serve", description=__doc__)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--preset", help=f"load {CONFIGS_DIR}/NAME.yaml")
    where.add_argument("--config", help="load a preset file from anywhere")
    for name, kwargs in _OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, **kwargs)
    return p


def _from_env(environ: dict[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, kwargs in _OPTIONS.items():
        value = environ.get(f"DUPLEX_{name.upper()}")
        if value is None:
            continue
        found[name] = value.split(",") if kwargs.get("nargs") else value
    return found


def load_preset(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> Preset:
    """Resolve every setting; raises ConfigError with a message naming the bad field."""
    environ = dict(os.environ if environ is None else environ)
    args = vars(parser().parse_args(argv))
    preset_name = args.pop("preset") or environ.get("DUPLEX_PRESET")
    config_file = args.pop("config") or environ.get("DUPLEX_CONFIG")
    if config_file:
        path = Path(config_file)
    else:
        preset_name = preset_name or default_preset()
        path = CONFIGS_DIR / f"{preset_name}.yaml"
        if not path.exists():
            known = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
            raise ConfigError(f"--preset: no preset named {preset_name!r} (known: {known})")
    data = read_yaml(path)
    name = str(data.pop("name", path.stem))
    description = str(data.pop("description", "")).strip()
    if "pipeline" not in data:
        raise ConfigError(f"{path}: pipeline: missing section")
    pipeline = parse_pipeline_config(data.pop("pipeline"), where=f"{path}: pipeline")
    merged: dict[str, Any] = {**data, **_from_env(environ)}
    merged.update({k: v for k, v in args.items() if v is not None})
    merged["preset"] = name
    try:
        settings = ServerSettings.model_validate(merged)
    except ValidationError as err:
        lines = [f"{path}: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
        raise ConfigError("\n".join(lines)) from None
    try:
        require_model(settings.session.turn_detection.type)
    except ModelNotInstalled as err:
        raise ConfigError(f"{path}: session.turn_detection: {err}") from None
    return Preset(settings, pipeline, description)
