"""Reading a call's recording back (duplex/media/recording.py) for the tests."""

from __future__ import annotations

import json
import wave
from pathlib import Path
from typing import Any

import numpy as np

RATE = 16000
FRAME = 320  # 20 ms


def read(folder: Path, call_id: str) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """The WAV's (n, 2) float samples and the log's lines."""
    with wave.open(str(folder / f"{call_id}.wav"), "rb") as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (2, 2, RATE)
        data = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").reshape(-1, 2)
    lines = [json.loads(line) for line in (folder / f"{call_id}.jsonl").read_text().splitlines()]
    return data.astype(np.float32) / 32768, lines


def runs(channel: np.ndarray, level: float = 0.02, gap_s: float = 0.3) -> list[tuple[float, float]]:
    """(start, end) seconds of the channel's audible stretches (20 ms frames above ``level``),
    stretches less than ``gap_s`` apart joined."""
    frames = len(channel) // FRAME
    loud = np.abs(channel[: frames * FRAME].reshape(frames, FRAME)).max(axis=1) > level
    found: list[list[float]] = []
    for i in np.nonzero(loud)[0]:
        start, end = i * FRAME / RATE, (i + 1) * FRAME / RATE
        if found and start - found[-1][1] < gap_s:
            found[-1][1] = end
        else:
            found.append([start, end])
    return [(a, b) for a, b in found]


def events(lines: list[dict[str, Any]], kind: str, side: str = "server") -> list[dict[str, Any]]:
    """The log's lines of events of ``kind``, sent by the server (or the client)."""
    return [line for line in lines if line["kind"] == side and line["event"]["type"] == kind]
