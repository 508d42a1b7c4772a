"""Audio as the Realtime protocol carries it in events: base64 ``audio/pcm`` (24 kHz s16 mono),
``audio/pcmu`` or ``audio/pcma`` (8 kHz G.711).

A decoder or encoder belongs to one session and one direction (the resampler keeps history across
chunks); the session replaces it when the client changes the format.

A long payload (minutes of audio in one ``conversation.item.create``) is decoded in slices of
:data:`SLICE_CHARS` base64 characters, each a short C call, so that the decoding can run on a
worker thread (``duplex.media.offloop``) without holding the GIL against the event loop for long.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from duplex.media.pcm import (
    alaw_decode,
    alaw_encode,
    float_to_pcm16,
    pcm16_to_float,
    ulaw_decode,
    ulaw_encode,
)
from duplex.media.resample import Resampler

PCM_RATE = 24000
G711_RATE = 8000
# Base64 characters decoded (and their samples converted and resampled) per call: a multiple of 4
# (whole base64 quanta) and of 8 (whole 16-bit samples), 1 s of 24 kHz pcm16, 6 s of G.711 — well
# under a millisecond of work each.
SLICE_CHARS = 64 * 1024


class AudioFormatError(ValueError):
    """The client's audio cannot be decoded in the session's input format."""


def _wire_rate(fmt: str) -> int:
    return PCM_RATE if fmt == "audio/pcm" else G711_RATE


def wire_seconds(fmt: str, b64: str) -> float:
    """How much audio the base64 text ``b64`` in ``fmt`` holds, from its length alone (before any
    decoding: what a budget is checked against)."""
    sample_bytes = 2 if fmt == "audio/pcm" else 1
    return len(b64) * 3 / 4 / sample_bytes / _wire_rate(fmt)


class InboundDecoder:
    """base64 audio in ``fmt`` → float32 mono at ``rate`` (the VAD/model rate)."""

    def __init__(self, fmt: str, rate: int = 16000) -> None:
        self.format = fmt
        self._resampler = Resampler(_wire_rate(fmt), rate)

    def decode(self, b64: str) -> np.ndarray:
        """The samples of ``b64``; AudioFormatError (before any of it reaches the resampler) when
        it is not valid base64 or not whole samples of the format."""
        raw = [_b64decode(b64[start : start + SLICE_CHARS], start + SLICE_CHARS >= len(b64))
               for start in range(0, len(b64), SLICE_CHARS)]
        if not raw:
            return np.zeros(0, dtype=np.float32)
        if self.format == "audio/pcm" and len(raw[-1]) % 2:  # slices before it are whole samples
            raise AudioFormatError("audio/pcm needs whole 16-bit samples (an even byte count)")
        return np.concatenate([self._resampler.push(self._samples(piece)) for piece in raw])

    def _samples(self, raw: bytes) -> np.ndarray:
        if self.format == "audio/pcm":
            return pcm16_to_float(np.frombuffer(raw, dtype="<i2"))
        if self.format == "audio/pcmu":
            return pcm16_to_float(ulaw_decode(raw))
        return pcm16_to_float(alaw_decode(raw))


def _b64decode(piece: str, last: bool) -> bytes:
    """One slice of a base64 text; padding may end only the last (as decoding it whole requires)."""
    try:
        if not last and piece.endswith("="):
            raise ValueError("Excess data after padding")
        return base64.b64decode(piece, validate=True)
    except (binascii.Error, ValueError) as err:
        raise AudioFormatError(f"audio is not valid base64: {err}") from None


class OutboundEncoder:
    """float32 mono at ``rate`` (the model's output) → base64 audio in ``fmt``."""

    def __init__(self, fmt: str, rate: int) -> None:
        self.format = fmt
        self.in_rate = rate
        out_rate = _wire_rate(fmt)
        self._resampler = None if rate == out_rate else Resampler(rate, out_rate)

    def encode(self, samples: np.ndarray) -> tuple[str, int]:
        """The base64 payload and how many wire samples it holds."""
        if self._resampler is not None:
            samples = self._resampler.push(samples)
        pcm = float_to_pcm16(samples)
        if self.format == "audio/pcm":
            raw = pcm.astype("<i2").tobytes()
        elif self.format == "audio/pcmu":
            raw = ulaw_encode(pcm)
        else:
            raw = alaw_encode(pcm)
        return base64.b64encode(raw).decode("ascii"), len(pcm)

    @property
    def rate(self) -> int:
        return _wire_rate(self.format)
