"""Audio formats at the edges of a session: resampling (PyAV) and G.711 (numpy).

Sample conventions used across duplex:

- float audio is ``float32`` in [-1, 1]; 16-bit audio is ``int16``;
- a mono signal is a 1-D array, a multi-channel one has shape ``(samples, channels)``.

Rates in play: aiortc decodes Opus to 48 kHz stereo s16; the VAD and the model take 16 kHz mono;
code2wav writes 24 kHz float32; the Realtime WebSocket speaks 24 kHz pcm16; telephony speaks
8 kHz G.711.

A :class:`Resampler` is stateful (the filter keeps a few samples of history so that consecutive
chunks join without clicks), so each stream direction of a session owns one and drops it with the
session; nothing here is shared between sessions. The G.711 functions are pure.
"""

from __future__ import annotations

import av
import numpy as np

# PyAV's packed sample formats for the two dtypes we carry.
_AV_FORMATS = {np.dtype(np.float32): "flt", np.dtype(np.int16): "s16"}


class Resampler:
    """One direction of one stream: any rate/layout/dtype in, another out.

    Built on ``av.AudioResampler`` (libswresample). ``push`` accepts chunks of any length and
    returns whatever output is ready (the filter holds back a few samples: about 32 at 24 → 48
    kHz); ``flush`` returns the held-back tail and re-arms the resampler for the next utterance,
    so the total output of a push…flush sequence is exactly ``len(input) * out_rate / in_rate``
    (rounded). With ``frame_size`` set, ``push`` returns whole frames of that many samples only
    (``flush`` returns the rest, its last frame possibly shorter).

    Channel changes (mono ↔ stereo) happen here, before libswresample, at unity gain: mono to
    stereo copies, stereo to mono averages. libswresample's own remix works at -3 dB, which
    makes the identical channels WebRTC decoders produce 3 dB louder than the source (past full
    scale for loud speech) and a copied mono voice 3 dB quieter.
    """

    def __init__(
        self,
        in_rate: int,
        out_rate: int,
        *,
        in_dtype: type[np.generic] = np.float32,
        out_dtype: type[np.generic] = np.float32,
        in_channels: int = 1,
        out_channels: int = 1,
        frame_size: int | None = None,
    ) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self.in_dtype = np.dtype(in_dtype)
        self.out_dtype = np.dtype(out_dtype)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.frame_size = frame_size
        self._resampler = self._new_resampler()

    def _new_resampler(self) -> av.AudioResampler:
        return av.AudioResampler(
            format=_AV_FORMATS[self.out_dtype],
            layout=_layout(self.out_channels),
            rate=self.out_rate,
            frame_size=self.frame_size,
        )

    def push(self, samples: np.ndarray) -> np.ndarray:
        """Resample a chunk (mono: 1-D; else ``(n, in_channels)``) of ``in_dtype`` samples."""
        samples = np.asarray(samples)
        if len(samples) == 0:
            return self._empty()
        if self.in_channels != self.out_channels:
            samples = _remix(samples.reshape(-1, self.in_channels), self.out_channels)
        samples = np.ascontiguousarray(samples, dtype=self.in_dtype)
        # No pts: positions in duplex are sample counts, and a timestamp gap (a lost packet)
        # would make the filter graph insert or drop samples.
        frame = av.AudioFrame.from_ndarray(
            samples.reshape(1, -1), format=_AV_FORMATS[self.in_dtype],
            layout=_layout(self.out_channels),
        )
        frame.sample_rate = self.in_rate
        return self._concat(self._resampler.resample(frame))

    def push_frame(self, frame: av.AudioFrame) -> np.ndarray:
        """Resample a decoded packed frame of ``in_dtype`` samples (e.g. aiortc's Opus output)."""
        return self.push(frame.to_ndarray().reshape(-1, len(frame.layout.channels)))

    def flush(self) -> np.ndarray:
        """Drain the samples the filter holds back, and start afresh for the next chunk."""
        tail = self._concat(self._resampler.resample(None))
        self._resampler = self._new_resampler()
        return tail

    def _concat(self, frames: list[av.AudioFrame]) -> np.ndarray:
        if not frames:
            return self._empty()
        # Packed formats come out as (1, samples * channels): interleaved.
        data = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])
        return data if self.out_channels == 1 else data.reshape(-1, self.out_channels)

    def _empty(self) -> np.ndarray:
        shape = (0,) if self.out_channels == 1 else (0, self.out_channels)
        return np.zeros(shape, dtype=self.out_dtype)


def _layout(channels: int) -> str:
    return {1: "mono", 2: "stereo"}[channels]


def _remix(samples: np.ndarray, channels: int) -> np.ndarray:
    """``(n, c)`` samples → ``channels`` channels at unity gain (average down, copy up)."""
    if channels == 1:
        return samples.mean(axis=1)
    return np.repeat(samples.reshape(-1), channels).reshape(-1, channels)


class FrameResampler:
    """Decoded s16 frames of any rate and layout → ``rate`` mono float32 (VAD, model).

    aiortc decodes Opus to 48 kHz stereo, G.722 to 16 kHz mono and G.711 to 8 kHz mono; which one
    a call gets depends on the client's offer, so the resampler follows the frames' own format
    (and starts afresh should it ever change).
    """

    def __init__(self, rate: int = 16000) -> None:
        self.rate = rate
        self._resampler: Resampler | None = None

    def push(self, frame: av.AudioFrame) -> np.ndarray:
        channels = len(frame.layout.channels)
        current = self._resampler
        if current is None or (current.in_rate, current.in_channels) != (
            frame.sample_rate, channels
        ):
            current = self._resampler = Resampler(
                frame.sample_rate, self.rate, in_dtype=np.int16, in_channels=channels
            )
        return current.push_frame(frame)


def webrtc_outbound(model_rate: int = 24000) -> Resampler:
    """The model's float32 mono waveform → 48 kHz mono s16 for the paced outbound track."""
    return Resampler(model_rate, 48000, out_dtype=np.int16)


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
