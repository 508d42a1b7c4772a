"""Resampling with PyAV: any rate, layout and dtype in, another out.

A mono signal is a 1-D array, a multi-channel one has shape ``(samples, channels)`` (sample
formats: ``duplex.media.pcm``). Rates in play: aiortc decodes Opus to 48 kHz stereo s16; the VAD
and the model take 16 kHz mono; code2wav writes 24 kHz float32; the Realtime WebSocket speaks
24 kHz pcm16; telephony speaks 8 kHz G.711.

A :class:`Resampler` is stateful (the filter keeps a few samples of history so that consecutive
chunks join without clicks), so each stream direction of a session owns one and drops it with the
session; nothing here is shared between sessions.
"""

from __future__ import annotations

import av
import av.filter
import numpy as np
from av.filter.context import FilterContext

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

    Each frame goes through libswresample once, as it came from the decoder: rate, layout and
    sample format change in the same call. Its stereo → mono remix sums the channels at -3 dB
    (each times 1/√2), so the output is scaled by 1/√2 again to give the channels' average at
    unity gain, as :class:`Resampler` does; float output cannot clip in between. This is one
    libswresample call per 20 ms frame instead of a numpy downmix, a new frame and then the
    resampler.

    The filter graph is the one ``av.AudioResampler`` builds (abuffer → aformat, libswresample
    inserted between them → abuffersink), driven directly: the resampling filter gives at most
    one frame per frame pushed (none while its delay swallows a tiny first frame), so one pull
    follows each push. ``av.AudioResampler`` pulls until the sink raises "try again", an
    exception that cost half as much as the resampling; driven this way a 20 ms frame takes
    ~20 µs here instead of ~37 µs, with the same samples (tests/media/test_inbound_resampling.py).

    State: the graph's filter history, for the one inbound stream that owns it.
    """

    def __init__(self, rate: int = 16000) -> None:
        self.rate = rate
        self._source: tuple[int, str, str] | None = None  # (rate, format, layout) so far
        self._graph: av.filter.Graph | None = None  # its filters refer to it weakly: kept here
        self._input: FilterContext | None = None  # the graph's abuffer
        self._output: FilterContext | None = None  # its abuffersink
        self._gain = np.float32(1.0)  # undoes libswresample's remix gain (_DOWNMIX_GAIN)

    def push(self, frame: av.AudioFrame) -> np.ndarray:
        source = (frame.sample_rate, frame.format.name, frame.layout.name)
        if self._source != source:
            self._source = source
            self._graph, self._input, self._output = self._new_graph(*source)
            self._gain = np.float32(_DOWNMIX_GAIN[len(frame.layout.channels)])
        assert self._input is not None and self._output is not None
        # No pts, as in Resampler.push: a timestamp gap (a lost packet) must not make the filter
        # graph insert or drop samples. The decoded frame is the caller's to change.
        frame.pts = None
        self._input.push(frame)
        try:
            out = self._output.pull()
        except BlockingIOError:  # the filter's delay took the whole (tiny, first) frame
            return _NO_SAMPLES
        # The plane is read in place (PyAV's to_ndarray stacks planes in Python); the product is
        # a new array.
        return np.frombuffer(out.planes[0], np.float32, out.samples) * self._gain

    def _new_graph(self, rate: int, sample_format: str,
                   layout: str) -> tuple[av.filter.Graph, FilterContext, FilterContext]:
        graph = av.filter.Graph()
        source = graph.add("abuffer", sample_rate=str(rate), sample_fmt=sample_format,
                           channel_layout=layout)
        convert = graph.add("aformat", sample_rates=str(self.rate), sample_fmts="flt",
                            channel_layouts="mono")
        sink = graph.add("abuffersink")
        source.link_to(convert)
        convert.link_to(sink)
        graph.configure()
        return graph, source, sink


# What undoes libswresample's remix to mono: its stereo matrix takes each channel at 1/√2.
_DOWNMIX_GAIN = {1: 1.0, 2: 2 ** -0.5}
_NO_SAMPLES = np.zeros(0, dtype=np.float32)
