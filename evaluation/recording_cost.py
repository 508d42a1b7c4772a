"""What recording a call costs (``--record-dir``): CPU per minute of call and bytes per minute.

    python -m evaluation.recording_cost [--minutes 5] [--rounds 3]

A real :class:`duplex.media.recording.CallRecording` is fed one simulated WebRTC call as the
server feeds it, on a clock of its own so that a call's minutes take a fraction of that: every
20 ms the caller's 16 kHz frame (``caller``) and, while the agent speaks, the 48 kHz frame the
paced sender took (``agent_played``: resampled to 16 kHz by the recording); the agent answers 4 s
of every 10, and each turn brings the events a real one does (speech started/stopped, committed,
a transcript, response created/done, a few hundred audio deltas of which only the size is
logged). CPU is the process time of the feeding loop (the recording's work and the loop's own
small share: frames are made once and reused), per minute of call; bytes are the WAV and the
JSON-lines file on disk at the end. Prints a table and writes
``evaluation/results/recording_cost.json``. Nothing here holds state between runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from duplex.media.recording import CallRecording
from evaluation.bench_common import format_table, machine, write_json

FRAME_S = 0.02
TURN_S = 10.0  # the caller speaks, the agent answers 4 s of every turn
AGENT_S = 4.0
DELTAS_PER_ANSWER = 200  # 20 ms audio deltas, logged by size only


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def turn_events(turn: int) -> list[tuple[str, dict[str, Any]]]:
    """The server events of one turn, in order, with a dummy payload where audio would be."""
    item, response = f"item_{turn}", f"resp_{turn}"
    events: list[tuple[str, dict[str, Any]]] = [
        ("server", {"type": "input_audio_buffer.speech_started", "item_id": item, "audio_start_ms": 0}),
        ("server", {"type": "input_audio_buffer.speech_stopped", "item_id": item, "audio_end_ms": 0}),
        ("server", {"type": "input_audio_buffer.committed", "item_id": item}),
        ("server", {"type": "conversation.item.input_audio_transcription.completed", "item_id": item,
                    "transcript": "What is the capital of Japan?"}),
        ("server", {"type": "response.created", "response": {"id": response}}),
    ]
    delta = "A" * 1280  # 20 ms of 24 kHz pcm16, base64
    events += [("server", {"type": "response.output_audio.delta", "response_id": response,
                           "item_id": f"out_{turn}", "delta": delta})] * DELTAS_PER_ANSWER
    events.append(("server", {"type": "response.done", "response": {"id": response, "status": "completed"}}))
    return events


def one_call(folder: Path, minutes: float) -> dict[str, float]:
    clock = Clock()
    recording = CallRecording(folder, f"call_{time.monotonic_ns()}", "webrtc", clock=clock)
    rng = np.random.default_rng(0)
    caller = (rng.normal(0, 0.05, 320)).astype(np.float32)
    agent = (rng.normal(0, 0.05, 960)).astype(np.float32)
    frames = int(minutes * 60 / FRAME_S)
    per_turn = int(TURN_S / FRAME_S)
    started = time.process_time()
    for i in range(frames):
        clock.now = i * FRAME_S
        recording.caller(caller, clock.now)
        into_turn = i % per_turn
        if into_turn == 0:
            for side, message in turn_events(i // per_turn):
                (recording.server_event if side == "server" else recording.client_event)(message)
        if into_turn * FRAME_S >= TURN_S - AGENT_S:
            recording.agent_played(agent, 48000, clock.now)
    clock.now = frames * FRAME_S
    recording.close("the benchmark's call ended")
    cpu = time.process_time() - started
    return {"cpu_s_per_call_minute": cpu / minutes,
            "wav_bytes_per_minute": recording.wav_path.stat().st_size / minutes,
            "log_bytes_per_minute": recording.log_path.stat().st_size / minutes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="minutes of call per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="duplex-recording-") as folder:
        rounds = [one_call(Path(folder), args.minutes) for _ in range(args.rounds)]
    result = {"machine": machine(), "minutes_per_round": args.minutes, "rounds": rounds,
              **{key: round(statistics.median(r[key] for r in rounds), 4) for key in rounds[0]}}
    result["cpu_percent_of_one_core"] = round(100 * result["cpu_s_per_call_minute"] / 60, 3)
    print(format_table(["per minute of call", "median"], [
        ["CPU seconds", result["cpu_s_per_call_minute"]],
        ["CPU, % of one core", result["cpu_percent_of_one_core"]],
        ["WAV bytes", int(result["wav_bytes_per_minute"])],
        ["log bytes", int(result["log_bytes_per_minute"])],
    ]))
    print(write_json("recording_cost", result))


if __name__ == "__main__":
    main()
