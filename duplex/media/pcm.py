"""Sample formats at the edges of a session: float32 ↔ int16 PCM, and G.711 μ-law / A-law.

Conventions used across duplex: float audio is ``float32`` in [-1, 1]; 16-bit audio is ``int16``.
Everything here is pure (the G.711 tables are computed once, at import).
"""

from __future__ import annotations

import numpy as np


def float_to_pcm16(samples: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] → int16, clipping what lies outside (no rate change)."""
    # The same scale as pcm16_to_float and libswresample (2**15), so conversions round-trip.
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int16)


def pcm16_to_float(samples: np.ndarray) -> np.ndarray:
    """int16 → float32 in [-1, 1) (no rate change)."""
    return samples.astype(np.float32) / 32768.0


# G.711 (ITU-T), the classic Sun/CCITT reference algorithm. The 16-bit input is rounded to the
# codec's 14 (μ-law) or 13 (A-law) bits, as sox does (audioop truncated instead, which biases
# negative samples by one step at each boundary). Encoding goes through 64 Ki-entry tables indexed
# by the int16 value, decoding through 256-entry tables, computed once, vectorised, at import.

def _rounded_pcm(bits: int) -> np.ndarray:
    """Every int16 value rounded (half up) to ``bits`` bits, clipped to that range."""
    shift = 16 - bits
    pcm = (np.arange(-32768, 32768, dtype=np.int32) + (1 << (shift - 1))) >> shift
    return np.minimum(pcm, (1 << (bits - 1)) - 1)


def _ulaw_encode_table() -> np.ndarray:
    pcm = _rounded_pcm(14)
    mask = np.where(pcm < 0, 0x7F, 0xFF)
    magnitude = np.minimum(np.where(pcm < 0, -pcm, pcm), 8159) + 0x21  # clip, add bias
    segment = np.searchsorted([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF], magnitude)
    # Only the very largest magnitudes land in segment 8: they take the maximum code.
    code = np.where(
        segment >= 8, 0x7F, (np.minimum(segment, 7) << 4) | ((magnitude >> (segment + 1)) & 0x0F)
    )
    return (code ^ mask).astype(np.uint8)


def _alaw_encode_table() -> np.ndarray:
    pcm = _rounded_pcm(13)
    mask = np.where(pcm >= 0, 0xD5, 0x55)
    magnitude = np.where(pcm >= 0, pcm, -pcm - 1)
    segment = np.searchsorted([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF], magnitude)
    # 13 bits never reach segment 8, unlike μ-law's biased 14.
    code = (segment << 4) | ((magnitude >> np.where(segment < 2, 1, segment)) & 0x0F)
    return (code ^ mask).astype(np.uint8)


def _ulaw_decode_table() -> np.ndarray:
    code = ~np.arange(256, dtype=np.int32) & 0xFF
    magnitude = (((code & 0x0F) << 3) + 0x84) << ((code & 0x70) >> 4)
    return np.where(code & 0x80, 0x84 - magnitude, magnitude - 0x84).astype(np.int16)


def _alaw_decode_table() -> np.ndarray:
    code = np.arange(256, dtype=np.int32) ^ 0x55
    segment = (code & 0x70) >> 4
    mantissa = (code & 0x0F) << 4
    magnitude = np.where(
        segment == 0, mantissa + 8, (mantissa + 0x108) << np.maximum(segment - 1, 0)
    )
    return np.where(code & 0x80, magnitude, -magnitude).astype(np.int16)


_ULAW_ENCODE = _ulaw_encode_table()
_ALAW_ENCODE = _alaw_encode_table()
_ULAW_DECODE = _ulaw_decode_table()
_ALAW_DECODE = _alaw_decode_table()


def ulaw_encode(pcm: np.ndarray) -> bytes:
    """int16 samples → G.711 μ-law bytes (PCMU)."""
    return _ULAW_ENCODE[pcm.astype(np.int32) + 32768].tobytes()


def alaw_encode(pcm: np.ndarray) -> bytes:
    """int16 samples → G.711 A-law bytes (PCMA)."""
    return _ALAW_ENCODE[pcm.astype(np.int32) + 32768].tobytes()


def ulaw_decode(data: bytes) -> np.ndarray:
    """G.711 μ-law bytes → int16 samples."""
    return _ULAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


def alaw_decode(data: bytes) -> np.ndarray:
    """G.711 A-law bytes → int16 samples."""
    return _ALAW_DECODE[np.frombuffer(data, dtype=np.uint8)]
