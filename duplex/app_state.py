"""What the server shares between its endpoints, for its whole life (``app.state.duplex``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from duplex.rate_limit import PerClient
from duplex.registry import SessionRegistry
from duplex.session.resume import ResumeStore
from duplex.settings import Preset, ServerSettings
from duplex.transports.binding import EVENT_BURST, EVENT_RATE
from duplex.transports.webrtc.ice import IcePolicy
from pipeline.coordinator import Coordinator

# Three connections' worth of the per-connection event limit.
CLIENT_EVENT_RATE = 3 * EVENT_RATE
CLIENT_EVENT_BURST = 3 * EVENT_BURST


@dataclass
class AppState:
    preset: Preset
    registry: SessionRegistry
    policy: IcePolicy
    pipeline: Coordinator | None = None  # None while the pipeline loads
    # Resume tokens and grace periods of Realtime WebSocket sessions (docs/resume.md); made with
    # the app from the preset's resume_grace_s.
    resumes: ResumeStore = field(default_factory=lambda: ResumeStore(0))
    # Those of WebRTC calls, apart: a token resumes only a session of the transport it was issued
    # on, so that neither endpoint is ever handed a session it cannot serve.
    call_resumes: ResumeStore = field(default_factory=lambda: ResumeStore(0))
    pipeline_error: str | None = None  # why it could not start
    # New Realtime WebSocket sessions per client address: a client that is closed for flooding
    # and comes straight back gets a fresh event budget each time; this bounds how often. 20 at
    # once (more than max_sessions allows anyway), then 2 a second.
    new_sessions: PerClient = field(default_factory=lambda: PerClient(rate=2.0, burst=20))
    # Client events per address, over all its Realtime WebSocket sessions, beside each connection's
    # own limit (``transports/binding.py``): a client that floods, is closed and reconnects does
    # not start again with a full budget.
    client_events: PerClient = field(default_factory=lambda: PerClient(
        rate=CLIENT_EVENT_RATE, burst=CLIENT_EVENT_BURST))

    @property
    def settings(self) -> ServerSettings:
        return self.preset.settings

    def serving_pipeline(self) -> Coordinator | None:
        """The pipeline when it serves; None while it loads, restarts a stage or after it failed."""
        pipeline = self.pipeline
        return pipeline if pipeline is not None and pipeline.ready else None
