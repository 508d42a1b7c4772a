"""The one turn-detection configuration: what a session's turn detector does, with its defaults
(OpenAI's, CONTRACT.md) and ranges written once here.

Server settings (``SessionDefaults.turn_detection``) and the wire format (``session.update``'s
``audio.input.turn_detection``) both convert to and from :class:`TurnDetection`; the detector in
``duplex.turns.server_vad`` reads it. Values are immutable: a change makes a new one.
"""

from __future__ import annotations

from dataclasses import dataclass

from duplex.turns.semantic_policy import Eagerness

TYPES = ("server_vad", "semantic_vad")

# Inclusive ranges. The upper bounds keep one session's settings from costing others: the VAD
# copies the prefix on every 32 ms window, and a silence of minutes would hold a turn open.
THRESHOLD_RANGE = (0.01, 0.99)
PREFIX_PADDING_MS_RANGE = (0, 5_000)
SILENCE_DURATION_MS_RANGE = (100, 10_000)
# OpenAI's bounds for idle_timeout_ms: shorter would cut into a caller's ordinary pause to think.
IDLE_TIMEOUT_MS_RANGE = (5_000, 30_000)


class TurnDetectionError(ValueError):
    """A value out of range; ``field`` names it (as in the wire format)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class TurnDetection:
    """``type`` server_vad: a turn ends after ``silence_duration_ms`` of silence; semantic_vad: when
    the end-of-turn model and the pause say the user has finished (``eagerness``), within a
    maximum wait. Both: speech probability threshold, audio kept before the onset, and whether the
    end of a turn answers / speech over the agent interrupts it. ``idle_timeout_ms`` (None: off):
    the caller silent that long after the agent's audio ended triggers a response
    (``duplex.session.idle``); OpenAI's wire format has it in server_vad only."""

    type: str = "server_vad"
    eagerness: str = "auto"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise TurnDetectionError("type", f"type must be one of {list(TYPES)}")
        if self.eagerness not in set(Eagerness):
            raise TurnDetectionError("eagerness", f"eagerness must be one of {[e.value for e in Eagerness]}")
        for name, (low, high) in (
            ("threshold", THRESHOLD_RANGE),
            ("prefix_padding_ms", PREFIX_PADDING_MS_RANGE),
            ("silence_duration_ms", SILENCE_DURATION_MS_RANGE),
        ):
            value = getattr(self, name)
            kind = float if name == "threshold" else int
            if isinstance(value, bool) or not isinstance(value, kind | int):
                raise TurnDetectionError(name, f"{name} must be {'a number' if kind is float else 'an integer'}")
            if not low <= value <= high:
                raise TurnDetectionError(name, f"{name} must be between {low} and {high}")
        idle = self.idle_timeout_ms
        if idle is not None:
            low, high = IDLE_TIMEOUT_MS_RANGE
            if isinstance(idle, bool) or not isinstance(idle, int):
                raise TurnDetectionError("idle_timeout_ms", "idle_timeout_ms must be an integer or null")
            if not low <= idle <= high:
                raise TurnDetectionError("idle_timeout_ms", f"idle_timeout_ms must be between {low} and {high}")
        for name in ("create_response", "interrupt_response"):
            if not isinstance(getattr(self, name), bool):
                raise TurnDetectionError(name, f"{name} must be true or false")
