"""What the audio front end costs and does (duplex/media/front_end.py): CPU per call-minute with
echo cancellation on and off and with noise suppression, and ERLE on a simulated speakerphone.

    python -m evaluation.echo_cost [--minutes 2]

A real :class:`~duplex.media.front_end.AudioFrontEnd` is fed one simulated call as a session
feeds it, on a clock of its own (a call's minutes take seconds): every 20 ms the paced sender's
48 kHz frame of the agent's espeak speech goes to its tap while the agent speaks (4 s of every
10), and the caller's 20 ms packet (the agent's echo ``delay`` later, -6 dB through a synthetic
room, plus, with noise, white noise 20 dB below speech) to ``process``. CPU is the process time
of that loop per minute of call. ERLE (echo return loss enhancement) is the echo's energy over
what is left of it after the canceller, from each answer's second second on, at 100, 250 and
500 ms of echo delay (the range AEC3's delay estimator covers). Prints a table and writes
``evaluation/results/echo_cost.json``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

import numpy as np

from duplex.media.front_end import AudioFrontEnd
from duplex.media.playout import ClientPlayout
from duplex.session.config import SessionConfig
from evaluation.bench_common import format_table, machine, write_json
from harness.speech import speech

RATE = 16000
PACKET = 320  # 20 ms at 16 kHz
TURN_S, AGENT_S = 10.0, 4.0
ANSWER = ("Tomorrow will be sunny in the morning, with clouds in the afternoon and a light breeze "
          "from the west; temperatures will reach twenty degrees.")
CONFIGS: dict[str, dict[str, Any]] = {
    "off": {"echo_cancellation": False},
    "echo cancellation": {},
    "noise_reduction near_field": {"echo_cancellation": False, "noise_reduction": {"type": "near_field"}},
    "echo + near_field": {"noise_reduction": {"type": "near_field"}},
    "echo + far_field": {"noise_reduction": {"type": "far_field"}},
}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def room_response(seed: int = 0) -> np.ndarray:
    """A synthetic room (150 ms, RT60 200 ms): a direct path and an exponentially decaying tail."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(0.15 * RATE)) / RATE
    h = rng.standard_normal(len(t)) * np.exp(-6.9 * t / 0.2) * 0.3
    h[0] = 1.0
    return h / np.sqrt(np.sum(h ** 2))


def simulated_call(minutes: float, delay_s: float, noise: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(agent at 48 kHz as played, agent's echo at the microphone, the microphone) for the call."""
    answer48 = speech(ANSWER, 48000, 0.0, 0.0)[: int(AGENT_S * 48000)]
    answer16 = speech(ANSWER, RATE, 0.0, 0.0)[: int(AGENT_S * RATE)]
    total = int(minutes * 60 * RATE)
    agent48 = np.zeros(total * 3, dtype=np.float32)
    agent16 = np.zeros(total, dtype=np.float32)
    for turn in range(int(minutes * 60 / TURN_S)):
        at = int((turn * TURN_S + TURN_S - AGENT_S) * RATE)
        agent48[at * 3 : at * 3 + len(answer48)] = answer48
        agent16[at : at + len(answer16)] = answer16
    echo = np.zeros(total, dtype=np.float32)
    lag = int(delay_s * RATE)
    echo[lag:] = 0.5 * np.convolve(agent16, room_response())[: total - lag]
    mic = echo.copy()
    if noise:
        mic += np.random.default_rng(1).standard_normal(total).astype(np.float32) * 0.01
    return agent48, echo, mic


def process_call(agent48: np.ndarray, mic: np.ndarray, changes: dict[str, Any]
                 ) -> tuple[np.ndarray, float]:
    """The microphone ``mic`` through a front end with ``changes`` to the session config, while
    ``agent48`` (48 kHz, as long) plays, as a paced transport reports it, on a clock of its own:
    (what the VAD would hear, CPU seconds it took)."""
    clock = Clock()
    front_end = AudioFrontEnd(ClientPlayout(), {"session_id": "bench"}, clock=clock)
    config = replace(SessionConfig(instructions="", voice="default"), **changes)
    out = np.zeros_like(mic)
    started = time.process_time()
    for i in range(0, len(mic) - PACKET + 1, PACKET):
        frame = agent48[i * 3 : (i + PACKET) * 3]
        if np.any(frame):
            front_end.far_end.agent_played(frame, 48000, clock.now)
        clock.now += PACKET / RATE
        out[i : i + PACKET] = front_end.process(mic[i : i + PACKET], clock.now, config)
    cpu_s = time.process_time() - started
    front_end.close()
    return out, cpu_s


def run(minutes: float, delay_s: float, changes: dict[str, Any], noise: bool = False
        ) -> dict[str, float]:
    agent48, echo, mic = simulated_call(minutes, delay_s, noise)
    out, cpu_s = process_call(agent48, mic, changes)
    # ERLE from each answer's second second on (the first one, converging, counts too: as heard).
    settled = np.zeros(len(mic), dtype=bool)
    for turn in range(int(minutes * 60 / TURN_S)):
        at = int((turn * TURN_S + TURN_S - AGENT_S + delay_s + 1.0) * RATE)
        settled[at : at + int((AGENT_S - 1.0) * RATE)] = True
    erle = 10 * np.log10(np.mean(echo[settled] ** 2) / (np.mean(out[settled] ** 2) + 1e-12))
    return {"cpu_s_per_call_minute": round(cpu_s / minutes, 3),
            "core_percent": round(100 * cpu_s / (minutes * 60), 2),
            "erle_db": round(float(erle), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="simulated call length")
    args = parser.parse_args()
    results: dict[str, Any] = {"machine": machine(), "minutes": args.minutes, "cpu": {}, "erle": {}}
    rows = []
    for name, changes in CONFIGS.items():
        measured = run(args.minutes, 0.25, changes, noise="noise" in name or "field" in name)
        results["cpu"][name] = measured
        rows.append([name, measured["cpu_s_per_call_minute"], measured["core_percent"]])
    print(format_table(["front end", "CPU s / call-minute", "% of a core"], rows))
    rows = []
    for delay_ms in (100, 250, 500):
        on = run(args.minutes, delay_ms / 1000, {})
        off = run(args.minutes, delay_ms / 1000, {"echo_cancellation": False})
        results["erle"][str(delay_ms)] = {"on_db": on["erle_db"], "off_db": off["erle_db"]}
        rows.append([delay_ms, on["erle_db"], off["erle_db"]])
    print()
    print(format_table(["echo delay ms", "ERLE dB (cancellation on)", "ERLE dB (off)"], rows))
    print(f"wrote {write_json('echo_cost', results)}")


if __name__ == "__main__":
    main()
