"""What the server shares between its endpoints, for its whole life (``app.state.duplex``)."""

from __future__ import annotations

from dataclasses import dataclass

from duplex.registry import SessionRegistry
from duplex.settings import Preset
from duplex.webrtc import IcePolicy
from pipeline.coordinator import Coordinator


@dataclass
class AppState:
    preset: Preset
    registry: SessionRegistry
    policy: IcePolicy
    pipeline: Coordinator | None = None  # None while the pipeline loads
    pipeline_error: str | None = None  # why it could not start

    @property
    def settings(self):  # noqa: ANN201 - ServerSettings; short alias used by every endpoint
        return self.preset.settings
