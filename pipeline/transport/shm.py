"""Tensors on the data plane: pickling that lifts large tensors and arrays into shared memory.

One serialisation mechanism for every message: ``pickle``, with a ``persistent_id`` hook that moves
each torch tensor or numpy array of at least ``threshold`` bytes into one shared-memory segment per
message (a file under /dev/shm). The control plane then carries only small pickles. Smaller torch
tensors travel inline as their raw bytes: torch's own pickling goes through ``torch.save``'s
machinery and costs about 0.3 ms a tensor each way, more than the rest of a hop.

torch is never imported here for its own sake: a process that has not imported it (the server
with a model set that needs none, its toy stages) can hold no tensor, and saves its ~1.5 s of
import at start. A process that receives a tensor imports it then.

Ownership: the ``ShmWriter`` of the sending endpoint creates a segment and owns it; the receiver
copies the tensors out (``loads``) and acknowledges; on that acknowledgement the writer unlinks the
segment (``release``). Whatever is still unacknowledged when the writer closes is unlinked then, so
nothing outlives the pipeline in /dev/shm. A message that could not be sent after all gives its
segment back at once (``release``), and one that could not be written (a full /dev/shm) leaves none.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "duplex-"


@dataclass(frozen=True)
class _Ref:
    """A tensor or array in a segment of shared memory."""

    segment: str
    offset: int
    nbytes: int
    is_torch: bool
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Inline:
    """A small torch tensor as its raw bytes, inside the pickle itself."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]


def _torch_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor (never, where torch was not imported: see module doc)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _raw_bytes(obj: Any) -> tuple[np.ndarray, bool, str, tuple[int, ...]] | None:
    """The bytes of a plain dense tensor or array, or None for what pickle must handle itself
    (sparse or quantized tensors, object or structured arrays, anything else)."""
    if _torch_tensor(obj):
        import torch

        if obj.layout != torch.strided or obj.is_quantized:
            return None
        t = obj.detach().cpu().contiguous()
        return t.reshape(-1).view(torch.uint8).numpy(), True, str(t.dtype), tuple(t.shape)
    if isinstance(obj, np.ndarray) and not obj.dtype.hasobject and obj.dtype.fields is None:
        a = np.ascontiguousarray(obj)
        return a.reshape(-1).view(np.uint8), False, a.dtype.str, a.shape
    return None


def _rebuild(buf: bytearray, is_torch: bool, dtype: str, shape: tuple[int, ...]) -> Any:
    """A tensor or array that owns ``buf`` (writable, independent of any segment)."""
    if is_torch:
        import torch

        torch_dtype = getattr(torch, dtype.removeprefix("torch."))
        if not buf:
            return torch.empty(shape, dtype=torch_dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(torch_dtype).reshape(shape)
    return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)


class _LiftingPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, threshold: int) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._threshold = threshold
        self.segment: str | None = None
        """The message's segment name, chosen when it lifts its first tensor."""
        self.lifted: list[np.ndarray] = []
        self.size = 0

    def persistent_id(self, obj: Any) -> _Ref | _Inline | None:
        raw = _raw_bytes(obj)
        if raw is None:
            return None
        data, is_torch, dtype, shape = raw
        if data.nbytes < self._threshold:
            # numpy pickles its arrays as raw bytes already; only torch needs the short cut.
            return _Inline(data.tobytes(), dtype, shape) if is_torch else None
        if self.segment is None:
            self.segment = f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}"
        ref = _Ref(self.segment, self.size, data.nbytes, is_torch, dtype, shape)
        self.lifted.append(data)
        self.size += data.nbytes
        return ref


class _LoweringUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.segments: set[str] = set()
        self._contents: dict[str, bytes] = {}

    def persistent_load(self, ref: _Ref | _Inline) -> Any:
        if isinstance(ref, _Inline):
            return _rebuild(bytearray(ref.data), True, ref.dtype, ref.shape)
        self.segments.add(ref.segment)
        content = self._contents.get(ref.segment)
        if content is None:
            content = (SHM_DIR / ref.segment).read_bytes()
            self._contents[ref.segment] = content
        buf = bytearray(content[ref.offset : ref.offset + ref.nbytes])
        return _rebuild(buf, ref.is_torch, ref.dtype, ref.shape)


class ShmWriter:
    """Pickles messages for one sending endpoint and owns the segments they lifted."""

    def __init__(self, threshold: int) -> None:
        self._threshold = threshold
        self._held: dict[str, int] = {}

    def dumps(self, obj: Any) -> bytes:
        return self.dump(obj)[0]

    def dump(self, obj: Any) -> tuple[bytes, str | None]:
        """The pickle of ``obj`` and the segment holding its lifted tensors (None: all inline).

        Raises OSError (a full /dev/shm) with no segment left behind.
        """
        buf = io.BytesIO()
        pickler = _LiftingPickler(buf, self._threshold)
        pickler.dump(obj)
        segment = pickler.segment
        if segment is not None:
            self._write(segment, pickler.lifted)
            self._held[segment] = pickler.size
        return buf.getvalue(), segment

    @staticmethod
    def _write(segment: str, lifted: list[np.ndarray]) -> None:
        """Create the segment with ``lifted`` in it; raises OSError (e.g. ENOSPC: /dev/shm is
        full) with nothing left behind, since a half-written segment would have no owner."""
        path = SHM_DIR / segment
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            try:
                for data in lifted:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def release(self, segment: str) -> None:
        if self._held.pop(segment, None) is not None:
            (SHM_DIR / segment).unlink(missing_ok=True)

    @property
    def bytes_held(self) -> int:
        return sum(self._held.values())

    def close(self) -> None:
        for segment in list(self._held):
            self.release(segment)


def loads(data: bytes) -> tuple[Any, set[str]]:
    """The message, with its tensors copied out of shared memory, and the segments to acknowledge."""
    unpickler = _LoweringUnpickler(io.BytesIO(data))
    return unpickler.load(), unpickler.segments


def remove_segments_of(pid: int) -> None:
    """Unlink the segments a dead process left: one killed before its writer closed (segment names
    carry the writer's pid; a process that closed its endpoints left none)."""
    for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}{pid}-*"):
        path.unlink(missing_ok=True)


def leftover_segments() -> list[Path]:
    """Segments of any duplex process still in /dev/shm (tests and shutdown checks)."""
    return sorted(SHM_DIR.glob(f"{SEGMENT_PREFIX}*"))
