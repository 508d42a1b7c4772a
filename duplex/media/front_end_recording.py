"""What a session's audio front end heard and made of it, for an operator debugging a call.

With the server's ``--front-end-record-dir DIR`` (off by default), every session writes
``DIR/<session id>.front_end.wav``: 16-bit PCM, 16 kHz, two channels, left the caller's audio as
it came into the front end (decoded and resampled, before echo cancellation and noise
suppression), right what the front end gave the VAD, turn detection and recognition. Both are on
the same clock, the audio's own: sample *n* of each channel is the *n*-th sample the front end
took and the *n*-th it gave back (it gives back as many as it takes), so the processing delay
(18 ms while processing, docs/audio_processing.md) shows as the right channel's lag. Where the
left channel has the agent's echo and the right one not, the canceller did its job; where both
have it, it did not (look at the agent's side in ``--record-dir``'s recording of the same call).

Bounded: at most :data:`MAX_S` of audio a session (~37 MB); the rest of a longer call is not
written (said once in the log). A write that fails (a full disk) ends the recording, never the call.

Ownership: one per session's :class:`~duplex.media.front_end.AudioFrontEnd`, made with it and
closed by its ``close`` (the WAV's header is complete then). Writes happen on the event loop, a
few kB at a time into a buffered file.
"""

from __future__ import annotations

import logging
import wave
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from duplex.media.pcm import float_to_pcm16

log = logging.getLogger(__name__)

RATE = 16000
MAX_S = 600.0  # ten minutes a session, ~37 MB


class FrontEndRecording:
    """See module doc. ``directory`` exists or is made; ``session_id`` names the file."""

    def __init__(self, directory: str | Path, session_id: str, log_extra: Mapping[str, Any]) -> None:
        self.log = logging.LoggerAdapter(log, dict(log_extra))
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{session_id}.front_end.wav"
        self._wav: wave.Wave_write | None = wave.open(str(self.path), "wb")
        self._wav.setnchannels(2)
        self._wav.setsampwidth(2)
        self._wav.setframerate(RATE)
        self._room = int(MAX_S * RATE)  # samples a channel may still take
        self.log.info("recording the audio front end's input and output in %s", self.path)

    def write(self, heard: np.ndarray, processed: np.ndarray) -> None:
        """The front end took ``heard`` and gave back ``processed`` (as long; 16 kHz float)."""
        if self._wav is None:
            return
        count = min(len(heard), self._room)
        if count < len(heard):
            self.log.info("front end recording stopped at its limit of %.0f s", MAX_S)
        stereo = np.empty((count, 2), dtype=np.int16)
        stereo[:, 0] = float_to_pcm16(heard[:count])
        stereo[:, 1] = float_to_pcm16(processed[:count])
        try:
            self._wav.writeframesraw(stereo.astype("<i2").tobytes())
        except OSError as err:
            self.log.warning("front end recording failed, stopped: %s", err)
            self._room = 0
        else:
            self._room -= count
        if not self._room:
            self.close()

    def close(self) -> None:
        """Complete the file (its header's length); idempotent."""
        if self._wav is not None:
            wav, self._wav = self._wav, None
            try:
                wav.close()
            except OSError as err:
                self.log.warning("front end recording could not be completed: %s", err)
