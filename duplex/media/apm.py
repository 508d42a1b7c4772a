"""WebRTC's audio processing module, one 10 ms frame at a time: the two stages of a session's audio
front end (duplex/media/front_end.py).

WebRTC's APM (the one browsers run) comes with the ``livekit`` wheel (Apache-2.0) as
``livekit.rtc.AudioProcessingModule``: a local native library, no LiveKit server involved. It
takes exactly 10 ms of 16-bit audio a call, in place.

- :class:`EchoCanceller`: AEC3 and its high-pass filter. Its output is used only while
  :class:`~duplex.media.echo_presence.EchoPresence` sees an echo; otherwise the caller's own audio,
  delayed by :data:`AEC_DELAY` as AEC3 delays it, so that switching is seamless.
- :class:`NoiseSuppressor`: WebRTC's noise suppressor (``near_field``), plus its automatic gain
  control for a far talker (``far_field``).

Each object belongs to one session's front end and holds one native APM, freed when it is dropped
(the wheel's handle releases it); neither is thread-safe, and both are used on the event loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from livekit import rtc  # ~130 ms to load: with the server, not on the loop at a call's first audio

from duplex.media.echo_presence import EchoPresence

RATE = 16000
FRAME = RATE // 100  # 10 ms: the only frame length the APM takes
AEC_DELAY = 128  # samples AEC3 delays the near end by (two of its 64-sample blocks): measured


class _Frame:
    """One reusable 10 ms int16 AudioFrame and a numpy view of its samples."""

    def __init__(self) -> None:
        self.frame = rtc.AudioFrame(bytearray(FRAME * 2), RATE, 1, FRAME)
        self.pcm = np.frombuffer(self.frame.data, dtype=np.int16)

    def load(self, samples: np.ndarray) -> Any:
        self.pcm[:] = np.clip(np.round(samples * 32768.0), -32768, 32767)
        return self.frame

    def samples(self) -> np.ndarray:
        return self.pcm.astype(np.float32) / 32768.0


class EchoCanceller:
    """AEC3, gated by the echo's presence (module doc)."""

    def __init__(self) -> None:
        self._apm = rtc.AudioProcessingModule(echo_cancellation=True, high_pass_filter=True)
        self._near = _Frame()
        self._far = _Frame()
        self._held = np.zeros(AEC_DELAY, dtype=np.float32)  # the caller's audio, delayed as AEC3's
        self.presence = EchoPresence()

    def resume(self) -> None:
        """Frames come again after a gap (the agent was silent): what was held before it is
        not the caller's audio of now."""
        self._held = np.zeros(AEC_DELAY, dtype=np.float32)

    def process(self, near: np.ndarray, far: np.ndarray) -> np.ndarray:
        """One frame of the caller's audio, ``far`` what played at the same moment."""
        self._apm.process_reverse_stream(self._far.load(far))
        # The far end is laid on the near end's clock already (duplex/media/far_end.py), so the
        # delay left is the echo's round trip, which AEC3's estimator finds itself; this build
        # ignores the hint anyway (measured: the same reach with any value).
        self._apm.set_stream_delay_ms(0)
        self._apm.process_stream(self._near.load(near))
        line = np.concatenate([self._held, near])
        self._held = line[FRAME:]
        if self.presence.update(far, near):
            return self._near.samples()
        return line[:FRAME]


class NoiseSuppressor:
    """WebRTC's noise suppression (``far_field``: with its automatic gain control)."""

    def __init__(self, far_field: bool) -> None:
        self._apm = rtc.AudioProcessingModule(noise_suppression=True, high_pass_filter=True,
                                                 auto_gain_control=far_field)
        self._near = _Frame()

    def process(self, near: np.ndarray) -> np.ndarray:
        self._apm.process_stream(self._near.load(near))
        return self._near.samples()
