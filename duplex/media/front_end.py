"""A session's audio front end: echo cancellation and noise suppression before anything listens.

What a caller sends passes here first, before the VAD, turn detection and recognition see it
(``Session.on_audio``). Two jobs, both done by WebRTC's audio processing module (the one browsers
run; duplex/media/apm.py):

- **Echo cancellation** (AEC3), on by default for SIP, Twilio and the WebSocket, off for WebRTC
  whose browsers cancel their own echo (``--[no-]echo-cancellation`` or a preset's
  ``session.echo_cancellation`` set it for every transport, a session's
  ``audio.input.echo_cancellation`` for itself): phones, SIP desk phones in hands-free mode,
  embedded devices and many Realtime WebSocket clients cancel nothing, and the agent would hear
  itself and interrupt itself. Its far-end reference is :class:`~duplex.media.far_end.FarEnd`, the
  AgentAudio's tap: the agent's audio as the caller heard it, on the transport's clock. Its output
  is used only where an echo is there at all (duplex/media/echo_presence.py): on a line without
  one, AEC3 would eat the first words of a caller who cuts in.
- **Noise suppression** for ``audio.input.noise_reduction`` (null by default, as OpenAI's):
  ``near_field`` (a close-talking microphone) is WebRTC's noise suppressor and the talk gate
  (duplex/media/talk_gate.py: the talk of people around the caller, which every suppressor keeps
  as speech, kept from the VAD by its lower level); ``far_field`` (a laptop or a room microphone,
  far from a quieter talker) is the suppressor and its automatic gain control. See
  docs/audio_processing.md for why WebRTC's suppressor rather than RNNoise (CPU, measured).

With ``--front-end-record-dir`` it also records, per session, what it took and what it gave
(duplex/media/front_end_recording.py), for an operator debugging a call.

Timing: the APM works on 10 ms frames. Inbound audio is cut into frames whose positions come from
their arrival (``received_at``) on the same monotonic clock as the far end, kept continuous across
jitter; each near-end frame goes to ``process_stream`` right after the far end of the same moment
went to ``process_reverse_stream``. The echo in a frame is thus the far end of round-trip time
ago (the caller's network, jitter buffers, loudspeaker, room and microphone), which AEC3's own
delay estimator finds: measured, 0 to ~500 ms (evaluation/echo_cost.py). The output is exactly
as long as the input. While processed, it is one frame (10 ms) later plus the APM's own ~8 ms;
echo cancellation alone processes only while the agent's audio or its echo may be in the
caller's (from its first sample to :data:`ECHO_TAIL_S` after its last), and the caller's audio
passes untouched, without that delay, the rest of the time (see ``_run``).

Cost (evaluation/echo_cost.py): ~0.3 ms of CPU per 10 ms frame processed (half of it the
native calls' own overhead), ~1.5% of a core over a call whose agent speaks 40% of the time. It
runs on the event loop where ``on_audio`` runs: an off-loop hop per 20 ms packet would add a
thread switch to every packet for 0.6 ms of work; a long ``input_audio_buffer.append`` reaches it
in the VAD's slices of 256 ms (~8 ms each, under DESIGN.md's 20 ms).

Ownership: one :class:`AudioFrontEnd` per session, made with it and released by its ``close``;
it owns its APM stages (native objects, freed when dropped), its talk gate, its :class:`FarEnd`,
its recording (if any, closed with it) and at most one 10 ms frame of audio in each direction.
It refers to the session's AgentAudio (whose tap it claims) and to nothing of the session itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from duplex.media.apm import FRAME, EchoCanceller, NoiseSuppressor
from duplex.media.far_end import JITTER_S, RATE, FarEnd
from duplex.media.front_end_recording import FrontEndRecording
from duplex.media.playout import AgentAudio
from duplex.media.talk_gate import TalkGate
from duplex.session.config import SessionConfig

log = logging.getLogger(__name__)

ECHO_TAIL_S = 0.6  # after the far end's last sample its echo may come back this long (AEC3's reach)
NOISE_REDUCTION = ("near_field", "far_field")


class AudioFrontEnd:
    """See module doc. ``audio``: the session's AgentAudio, whose tap becomes this front end's
    :class:`FarEnd`; ``log_extra``: the session's logging fields (its id); ``record_dir``: where
    to record what it takes and gives (``--front-end-record-dir``; None: nowhere)."""

    def __init__(self, audio: AgentAudio, log_extra: Mapping[str, Any],
                 clock: Callable[[], float] = time.monotonic, record_dir: str | None = None) -> None:
        self.far_end = FarEnd(clock)
        self._audio: AgentAudio | None = audio
        self.log = logging.LoggerAdapter(log, dict(log_extra))
        self.echo: EchoCanceller | None = None
        self._noise: NoiseSuppressor | None = None
        self.gate: TalkGate | None = None  # near_field's, after the suppressor
        self._wanted: tuple[bool, str | None] = (False, None)  # (echo, noise) being done
        self._engaged = False  # whether the audio goes through the stages now (see _run)
        self._echo_due = False  # whether the agent's echo may be in the caller's audio now
        self._pending = np.zeros(0, dtype=np.float32)  # near-end samples short of a frame
        self._out = np.zeros(FRAME, dtype=np.float32)  # processed samples not returned yet
        self._near_end: int | None = None  # timeline position after the last near-end sample
        self.frames = 0  # 10 ms frames processed (metrics, tests)
        self.recording: FrontEndRecording | None = None if record_dir is None else \
            FrontEndRecording(record_dir, str(log_extra.get("session_id", "session")), log_extra)
        self._claim_tap()

    @property
    def active(self) -> bool:
        """Whether echo cancellation or noise reduction is on."""
        return self.echo is not None or self._noise is not None

    @property
    def engaged(self) -> bool:
        """Whether the last audio went through the stages (noise reduction, or the agent's echo)."""
        return self.active and self._engaged

    def _claim_tap(self) -> None:
        """Be the AgentAudio's tap, passing on to whatever tap was there. A call's recording, made
        by the transport's binding after the session, joins as ``far_end.downstream``."""
        audio = self._audio
        if audio is not None:
            self.far_end.downstream = audio.tap
            audio.tap = self.far_end

    def process(self, samples: np.ndarray, received_at: float, config: SessionConfig) -> np.ndarray:
        """The caller's 16 kHz float32 ``samples`` (their last one arrived at ``received_at``) as
        the VAD and the model should hear them: echo cancelled and noise suppressed as ``config``
        says. As many samples as came in."""
        out = self._process(samples, received_at, config)
        if self.recording is not None:
            self.recording.write(samples, out)
        return out

    def _process(self, samples: np.ndarray, received_at: float, config: SessionConfig) -> np.ndarray:
        noise = (config.noise_reduction or {}).get("type")
        wanted = (config.echo_cancellation, noise if noise in NOISE_REDUCTION else None)
        if wanted != self._wanted:
            self._configure(wanted)
        if not self.active or not len(samples):
            return samples
        try:
            return self._run(np.asarray(samples, dtype=np.float32), received_at)
        except RuntimeError as err:  # the native side refused a frame: the call goes on without
            self.log.warning("audio processing failed, turned off for this session: %s", err)
            self.echo = self._noise = self.gate = None
            return samples

    def _configure(self, wanted: tuple[bool, str | None]) -> None:
        echo, noise = wanted
        if echo != self._wanted[0]:
            self.echo = EchoCanceller() if echo else None
        if noise != self._wanted[1]:
            self._noise = NoiseSuppressor(noise == "far_field") if noise else None
            self.gate = TalkGate() if noise == "near_field" else None
        self._wanted = wanted
        self._engaged = False
        self.log.info("audio front end: echo cancellation %s, noise reduction %s",
                      "on" if echo else "off", noise or "off")

    def _run(self, samples: np.ndarray, received_at: float) -> np.ndarray:
        start = self.far_end.pos(received_at) - len(samples)
        if self._near_end is not None and (start < self._near_end or
                                           abs(start - self._near_end) <= JITTER_S * RATE):
            start = self._near_end  # continuous with the audio before it
        self._near_end = start + len(samples)
        # Echo cancellation runs only while an echo may come back (the agent's audio and its
        # tail): the rest of the time AEC3 sees neither stream, so the two stay aligned across the
        # gap, and its echo presence learns from echo-time audio only (fed the caller's own words
        # with a silent far end, it took the next answer's start for no echo and let it through).
        # Alone, it engages the front end only then: the caller's audio passes untouched and
        # without the stages' delay the rest of the time. Engaging delays the audio by ~18 ms (its
        # first samples are silence), disengaging drops the ~18 ms held: as the agent starts, and
        # ECHO_TAIL_S after it ended (with noise reduction on, ~8 ms: AEC3's own delay).
        echo_due = self.echo is not None and self.far_end.playing(
            start - int(ECHO_TAIL_S * RATE), self._near_end)
        if echo_due and not self._echo_due:
            assert self.echo is not None
            self.echo.resume()
        self._echo_due = echo_due
        needed = self._noise is not None or echo_due
        if not needed:
            self._engaged = False
            return samples
        if not self._engaged:
            self._engaged = True
            self._pending = np.zeros(0, dtype=np.float32)
            self._out = np.zeros(FRAME, dtype=np.float32)
        near = np.concatenate([self._pending, samples])
        first = start - len(self._pending)  # the timeline position of near[0]
        whole = len(near) // FRAME * FRAME
        processed = [self._out]
        for offset in range(0, whole, FRAME):
            frame = near[offset : offset + FRAME]
            if echo_due:
                assert self.echo is not None
                frame = self.echo.process(frame, self.far_end.read(first + offset, FRAME))
            if self._noise is not None:
                cleaned = self._noise.process(frame)
                frame = cleaned if self.gate is None else self.gate.process(cleaned, frame)
            processed.append(frame)
        self.frames += whole // FRAME
        self._pending = near[whole:]
        out = np.concatenate(processed)
        self._out = out[len(samples):]
        self.far_end.forget(first + whole)
        return out[: len(samples)]

    def close(self) -> None:
        """The session closed: free the stages and the far end, and let go of the AgentAudio."""
        self.echo = self._noise = self.gate = None
        if self._audio is not None and self._audio.tap is self.far_end:
            self._audio.tap = self.far_end.downstream  # what was there before
        self.far_end.close()
        if self.recording is not None:
            self.recording.close()
        self._audio = None
        self._pending = self._out = np.zeros(0, dtype=np.float32)
