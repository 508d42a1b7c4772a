"""A session's settings: what ``session.update`` changes, owned by one session for its life.

Values are immutable; an update makes a new :class:`SessionConfig`. The wire format converts to and
from it in ``duplex.protocol.session_update``. The JSON-shaped fields (tools, tracing, ...) hold the
client's validated objects as sent, so that ``session.updated`` echoes them; nothing mutates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from duplex.turns.config import TurnDetection


@dataclass(frozen=True)
class SessionConfig:
    """``turn_detection`` None means manual turns (``input_audio_buffer.commit``). ``voice`` is
    the name the client chose (echoed as sent); the preset's ``voice_map`` says which voice of the
    model speaks for it. ``max_output_tokens`` None is ``"inf"`` (the preset's caps still apply).

    Applied: instructions, voice, output_modalities, max_output_tokens, turn_detection, formats,
    tools and tool_choice (function calls), transcription (presets whose model does not transcribe
    run their recognition stage only when it is set, or under semantic_vad; a model that
    transcribes anyway reports every turn; its model name is recorded, not chosen),
    noise_reduction and echo_cancellation (duplex/media/front_end.py). Recorded and echoed only
    (the model has no such knob): speed, tracing, include,
    truncation, prompt."""

    instructions: str
    voice: str
    output_modalities: tuple[str, ...] = ("audio",)
    max_output_tokens: int | None = None
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    transcription: dict[str, Any] | None = None
    noise_reduction: dict[str, Any] | None = None
    # duplex's own ``audio.input.echo_cancellation``: cancel the agent's echo from the caller's
    # audio (duplex/media/front_end.py); the server's default is ``SessionDefaults.echo_cancellation``.
    echo_cancellation: bool = True
    speed: float = 1.0
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] = "auto"
    tracing: str | dict[str, Any] | None = None
    include: tuple[str, ...] = ()
    truncation: str | dict[str, Any] = "auto"
    prompt: dict[str, Any] | None = None

    @property
    def speaks(self) -> bool:
        return "audio" in self.output_modalities
