"""What the server shares between its endpoints, for its whole life (``app.state.duplex``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from duplex.rate_limit import PerClient
from duplex.registry import SessionRegistry
from duplex.settings import Preset, ServerSettings
from duplex.transports.webrtc.ice import IcePolicy
from pipeline.coordinator import Coordinator


@dataclass
class AppState:
    preset: Preset
    registry: SessionRegistry
    policy: IcePolicy
    pipeline: Coordinator | None = None  # None while the pipeline loads
    pipeline_error: str | None = None  # why it could not start
    # New Realtime WebSocket sessions per client address: a client that is closed for flooding
    # and comes straight back gets a fresh event budget each time; this bounds how often. 20 at
    # once (more than max_sessions allows anyway), then 2 a second.
    new_sessions: PerClient = field(default_factory=lambda: PerClient(rate=2.0, burst=20))

    @property
    def settings(self) -> ServerSettings:
        return self.preset.settings

    def serving_pipeline(self) -> Coordinator | None:
        """The pipeline when it serves; None while it loads, restarts a stage or after it failed."""
        pipeline = self.pipeline
        return pipeline if pipeline is not None and pipeline.ready else None
