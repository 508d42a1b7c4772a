"""A session's settings: what ``session.update`` changes, owned by one session for its life.

Values are immutable; an update makes a new :class:`SessionConfig`. The wire format converts to and
from it in ``duplex.protocol.session_update``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from duplex.turns.config import TurnDetection


@dataclass(frozen=True)
class SessionConfig:
    """``turn_detection`` None means manual turns (``input_audio_buffer.commit``)."""

    instructions: str
    voice: str
    output_modalities: tuple[str, ...] = ("audio",)
    max_output_tokens: int | None = None
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"

    @property
    def speaks(self) -> bool:
        return "audio" in self.output_modalities
