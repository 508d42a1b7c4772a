"""Speculative start, measured: semantic_vad sessions on the offline preset answering spoken
questions, with the answer begun at each pause (the default) and without, one after the other on
the same questions and the same pipeline.

    python -m evaluation.speculation_bench [--rounds 1]

Each question (piper's natural voice) is fed to a real Session in real time, 20 ms at a time, then
silence until the answer's first audio; the audio sink is the client-played one (as the Realtime
WebSocket has), so the first ``response.output_audio.delta`` is when a client would start playing.
Measured from the last sample of speech: the end-of-turn decision (``input_audio_buffer.committed``)
and the first agent audio. With speculation the answer was begun at the pause, ~0.2 s after the
speech, so the first audio can come soon after the decision; the words of the pause (the
speculative request's transcript) also take part in the decision. Also counted: speculative
answers aborted (begun at a pause that was not the end). Prints a table, writes
``evaluation/results/speculation_bench.{json,png}``. Nothing here holds state between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import matplotlib
import numpy as np
from prometheus_client import REGISTRY

from duplex.media.playout import ClientPlayout
from duplex.session.session import Session
from duplex.settings import SessionDefaults
from duplex.turns.config import TurnDetection
from evaluation.bench_common import ROOT, format_table, machine, save_figure, save_results
from evaluation.live_session import silence_until, speak
from harness.speech import natural_speech
from pipeline.config import parse_pipeline_config, read_yaml
from pipeline.models.offline.sources import lm_source, prepare_lm
from pipeline.runner import start_pipeline

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RATE = 16000
QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is frozen water called?",
    "What is the capital of Japan?",
    "I would like to order a large pizza with mushrooms.",
    "Tell me something about the moon.",
]
MAX_WAIT_S = 8.0


class Listener:
    """The session's transport: every server event with its arrival time."""

    kind = "websocket"

    def __init__(self) -> None:
        self.events: list[tuple[float, dict[str, Any]]] = []

    def send_event(self, event: dict[str, Any]) -> None:
        self.events.append((time.perf_counter(), event))

    def first(self, kind: str) -> float | None:
        return next((t for t, e in self.events if e["type"] == kind), None)


def aborted_speculations() -> float:
    return REGISTRY.get_sample_value("duplex_speculative_responses_total",
                                     {"outcome": "aborted"}) or 0.0


async def one_turn(pipeline: Any, question: str, speculate: bool) -> dict[str, float | None]:
    listener = Listener()
    defaults = SessionDefaults(speculative_start=speculate, turn_detection=TurnDetection(
        type="semantic_vad", eagerness="auto"))
    session = Session("sess_bench", listener, ClientPlayout(), pipeline, defaults, ["default"],
                      "offline")
    audio = natural_speech(question, RATE, 0.3, 0.0)
    aborted = aborted_speculations()
    try:
        await speak(session, audio)
        spoken = time.perf_counter()
        await silence_until(session, lambda: listener.first("response.output_audio.delta") is not None,
                            MAX_WAIT_S)
        committed, audio_at = listener.first("input_audio_buffer.committed"), \
            listener.first("response.output_audio.delta")
        return {
            "decision_ms": None if committed is None else (committed - spoken) * 1000,
            "first_audio_ms": None if audio_at is None else (audio_at - spoken) * 1000,
            "aborted": aborted_speculations() - aborted,
        }
    finally:
        await session.close()


def summary(turns: list[dict[str, float | None]]) -> dict[str, Any]:
    def stat(key: str) -> dict[str, float | None]:
        values = [t[key] for t in turns if t[key] is not None]
        if not values:
            return {"median": None, "p90": None}
        return {"median": round(statistics.median(values)),
                "p90": round(float(np.percentile(values, 90)))}

    return {"decision_ms": stat("decision_ms"), "first_audio_ms": stat("first_audio_ms"),
            "decision_to_audio_ms": stat("gap_ms"),
            "aborted_speculations": sum(t["aborted"] or 0 for t in turns),
            "unanswered": sum(t["first_audio_ms"] is None for t in turns)}


async def run(rounds: int) -> dict[str, Any]:
    config = parse_pipeline_config(read_yaml(ROOT / "configs" / "offline.yaml")["pipeline"])
    await asyncio.to_thread(prepare_lm, lm_source("packaged"))
    pipeline = await start_pipeline(config, mode="process")
    try:
        await one_turn(pipeline, "Hello there.", True)  # warm-up
        modes: dict[str, list[dict[str, float | None]]] = {"speculative": [], "after the decision": []}
        for _ in range(rounds):
            for question in QUESTIONS:
                # Alternating, so that both see the same load over the run.
                for name, speculate in (("speculative", True), ("after the decision", False)):
                    turn = await one_turn(pipeline, question, speculate)
                    if turn["decision_ms"] is not None and turn["first_audio_ms"] is not None:
                        turn["gap_ms"] = turn["first_audio_ms"] - turn["decision_ms"]
                    else:
                        turn["gap_ms"] = None
                    modes[name].append(turn)
        return {"machine": machine(), "questions": QUESTIONS, "rounds": rounds,
                "modes": {name: summary(turns) for name, turns in modes.items()},
                "turns": modes}
    finally:
        await pipeline.close()


def plot(results: dict[str, Any], path: Any) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(results["modes"])
    x = np.arange(len(names))
    for offset, key, label in ((-0.2, "decision_ms", "end-of-turn decision"),
                               (0.2, "first_audio_ms", "first agent audio")):
        ax.bar(x + offset, [results["modes"][n][key]["median"] or 0 for n in names], 0.4, label=label)
    ax.set_xticks(x, names)
    ax.set_ylabel("ms after the end of speech (median)")
    ax.set_title("semantic_vad on the offline preset: speculative start")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    results = asyncio.run(run(args.rounds))
    rows = [[name, m["decision_ms"]["median"], m["decision_ms"]["p90"], m["first_audio_ms"]["median"],
             m["first_audio_ms"]["p90"], m["decision_to_audio_ms"]["median"],
             m["aborted_speculations"], m["unanswered"]]
            for name, m in results["modes"].items()]
    print(format_table(["answer begun", "decision p50", "p90", "first audio p50", "p90",
                        "decision -> audio p50", "speculations aborted", "unanswered"], rows))
    save_results("speculation_bench", results, plot)


if __name__ == "__main__":
    main()
