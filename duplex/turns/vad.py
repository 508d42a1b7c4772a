"""Streaming voice activity detection: silero-vad's ONNX model run by onnxruntime, one stream per
session.

:class:`VadStream` turns 512-sample windows (32 ms at 16 kHz) of float32 mono audio into speech
probabilities, carrying the model's LSTM state and its 64 samples of context from window to window
exactly as silero's own ``OnnxWrapper`` does (same model file, same session options, so the same
probabilities), without the wrapper's torch tensors around every call: that wrapper spent more
time converting and checking than the model spent inferring.

The ``onnxruntime.InferenceSession`` is loaded once per process and shared: it holds no per-stream
state, and every stream runs on the event loop's thread, one window at a time. A stream's own
buffers (input with context, two state arrays, the output) and its IO bindings belong to one
session and are dropped with it. silero_vad itself is never imported here (its import pulls in
torch and sets torch's thread count process-wide); only its packaged model file is read.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import onnxruntime

SAMPLE_RATE = 16000
WINDOW = 512  # the samples per inference that silero-vad's 16 kHz model takes
CONTEXT = 64  # samples of the previous window the model sees before each window (16 kHz)
# The 16 kHz-only export (opset 15) runs ~13% faster here than the default 8/16 kHz one.
MODEL_FILE = "silero_vad_16k_op15.onnx"


def model_path() -> Path:
    """The ONNX file inside the installed silero-vad package (found without importing it)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("silero-vad is not installed")
    return Path(spec.submodule_search_locations[0]) / "data" / MODEL_FILE


@functools.cache
def shared_session() -> onnxruntime.InferenceSession:
    """The process's one VAD session: one thread per inference, as silero's wrapper sets it (a
    window takes ~0.15 ms; more threads would only contend with the media path)."""
    options = onnxruntime.SessionOptions()
    options.inter_op_num_threads = 1
    options.intra_op_num_threads = 1
    return onnxruntime.InferenceSession(
        str(model_path()), sess_options=options, providers=["CPUExecutionProvider"]
    )


class VadStream:
    """Speech probability per window for one audio stream (see module doc)."""

    def __init__(self) -> None:
        session = shared_session()
        self._input = np.zeros((1, CONTEXT + WINDOW), dtype=np.float32)  # context, then window
        self._output = np.zeros((1, 1), dtype=np.float32)
        states = (np.zeros((2, 1, 128), dtype=np.float32), np.zeros((2, 1, 128), dtype=np.float32))
        rate = np.array(SAMPLE_RATE, dtype=np.int64)
        # Two IO bindings over these same arrays, reading the state from one and writing the next
        # into the other, alternate window by window: no array is allocated or copied per call.
        self._bindings = []
        for read, write in ((0, 1), (1, 0)):
            binding = session.io_binding()
            binding.bind_cpu_input("input", self._input)
            binding.bind_cpu_input("sr", rate)
            binding.bind_cpu_input("state", states[read])
            binding.bind_ortvalue_output("output", onnxruntime.OrtValue.ortvalue_from_numpy(self._output))
            binding.bind_ortvalue_output("stateN", onnxruntime.OrtValue.ortvalue_from_numpy(states[write]))
            self._bindings.append(binding)
        self._states = states  # kept alive here: the bindings point into them
        self._rate = rate
        self._next = 0  # which binding runs the next window
        self._session = session

    def probability(self, window: np.ndarray) -> float:
        """The speech probability of one ``WINDOW``-sample float32 window."""
        if len(window) != WINDOW:
            raise ValueError(f"a VAD window is {WINDOW} samples, not {len(window)}")
        self._input[0, :CONTEXT] = self._input[0, WINDOW:]  # the previous window's last samples
        self._input[0, CONTEXT:] = window
        self._session.run_with_iobinding(self._bindings[self._next])
        self._next ^= 1
        return float(self._output[0, 0])
