"""The offline model set (configs/offline.yaml) answering spoken questions, as the server runs it.

    python -m evaluation.offline_bench [--mode process|inproc] [--rounds 1]
        [--set STAGE.OPTION=VALUE ...] [--name offline_bench] [--conversation] [--end-of-turn]

Eight espeak-ng questions go through ``start_pipeline`` one after another (after one warm-up), each
submitted the way the session does at its end-of-turn decision. Per request, from submit: the
transcript chunk (speech recognition done), the first answer text (LM prefill and first token),
the first agent audio, and the end; per stage, the mean compute of one step (``asr``: one
transcription, ``lm``: one token, ``tts``: one clause) from the pipeline's own step histogram; and
the wait for the first clause's text (the splitter needs a clause before synthesis starts).
Prints a table, writes evaluation/results/offline_bench.{json,png} (``--name``: another name, for
a variant). The agent's answers and the recognised questions are in the JSON (with their WER) so
the numbers can be read against them, and so is what Whisper hears of the answers' speech (its WER
against the answer text: how intelligible the synthesis is, clause seams included). ``--set``
changes a stage of configs/offline.yaml for the run; ``--conversation`` asks the questions as one
conversation, each after the ones before and their answers (the prompt grows as in a call) (``threads`` is the stage's own field, any
other name one of its ``options``), to compare variants. ``--end-of-turn``: each request also asks
whether its words are finished (``params["end_of_turn"]``), as semantic_vad's speculative answer
begun at a pause does; the judgement comes with the transcript.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from prometheus_client import REGISTRY

from evaluation.bench_common import (
    ROOT,
    apply_stage_changes,
    format_table,
    machine,
    save_figure,
    save_results,
)
from harness.speech import speech
from harness.wer import wer
from pipeline.config import parse_pipeline_config, read_yaml
from pipeline.coordinator import Coordinator
from pipeline.models.offline.asr import Transcriber
from pipeline.models.offline.sources import asr_model_dir, lm_source, prepare_lm
from pipeline.proto import OmniRequest
from pipeline.runner import start_pipeline

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RATE = 16000
STAGES = ("asr", "judge", "lm", "tts")
QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is frozen water called?",
    "What is the capital of Japan?",
    "What color is the sky on a clear day?",
    "Can you recommend a good book?",
    "How do I make a cup of tea?",
    "Tell me something about the moon.",
]
PHASES = ("transcript", "first_text", "first_clause_text", "first_audio", "done")


@dataclass
class Turn:
    question: str
    times: dict[str, float] = field(default_factory=dict)
    transcript: str = ""
    text: str = ""
    audio: list[np.ndarray] = field(default_factory=list)  # the answer's speech, clause by clause
    rate: int = 0
    first_clause: str = ""
    finished: float | None = None  # P(finished) of its words, where it was asked (--end-of-turn)


async def ask(coordinator: Coordinator, rid: str, question: str,
              history: list[dict[str, Any]] | None = None, end_of_turn: bool = False) -> Turn:
    """``question`` spoken, after the conversation ``history`` (text messages), if any;
    ``end_of_turn``: judged as well (module doc)."""
    turn = Turn(question)
    message = {"role": "user", "text": None, "audio": speech(question, RATE), "sample_rate": RATE}
    params: dict[str, Any] = {"modalities": ["text", "audio"]}
    if end_of_turn:
        params["end_of_turn"] = True
    request = OmniRequest(rid, {"messages": [*(history or []), message]}, params)
    text_times: list[tuple[float, int]] = []  # (arrival, length of the text so far)
    first_clause = ""
    start = time.perf_counter()
    async for chunk in coordinator.stream(request):
        now = time.perf_counter() - start
        data = chunk.data
        if "input_transcript" in data:
            turn.transcript = data["input_transcript"]
            turn.times["transcript"] = now
        if "input_end_of_turn" in data:
            turn.finished = round(float(data["input_end_of_turn"]), 3)
        if data.get("text"):
            turn.times.setdefault("first_text", now)
            turn.text += data["text"]
            text_times.append((now, len(turn.text)))
        if "audio" in data:
            turn.times.setdefault("first_audio", now)
            first_clause = first_clause or data["spoken_text"]
            turn.audio.append(np.asarray(data["audio"], dtype=np.float32))
            turn.rate = data["sample_rate"]
    turn.times["done"] = time.perf_counter() - start
    # The splitter releases a clause once the character after it arrived (or the answer ended).
    ready = [t for t, length in text_times if length > len(first_clause)]
    turn.first_clause = first_clause
    turn.times["first_clause_text"] = (
        ready[0] if ready else text_times[-1][0] if text_times else 0.0
    )
    return turn


def step_totals() -> dict[str, tuple[float, float]]:
    """(sum of step seconds, number of steps) per stage, from the coordinator's histogram."""
    out = {}
    for stage in STAGES:
        total = REGISTRY.get_sample_value("pipeline_stage_seconds_sum", {"stage": stage}) or 0.0
        count = REGISTRY.get_sample_value("pipeline_stage_seconds_count", {"stage": stage}) or 0.0
        out[stage] = (total, count)
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    data = np.asarray(values) * 1000
    return {
        "p50": round(float(np.percentile(data, 50)), 1),
        "p90": round(float(np.percentile(data, 90)), 1),
    }


def configured(changes: list[str]) -> dict[str, Any]:
    """configs/offline.yaml's pipeline with each ``STAGE.OPTION=VALUE`` of ``changes`` applied
    (``threads``: the stage's own field)."""
    pipeline = read_yaml(ROOT / "configs" / "offline.yaml")["pipeline"]
    apply_stage_changes(pipeline, changes, frozenset({"threads"}))
    return pipeline


def spoken_wer(turns: list[Turn]) -> list[float]:
    """Whisper tiny.en (the preset's recogniser) on each answer's speech, against its text."""
    hear = Transcriber(asr_model_dir("packaged"), threads=2)
    return [wer(t.text, hear.transcribe(np.concatenate(t.audio), t.rate)) if t.audio else 1.0
            for t in turns]


async def run(mode: str, rounds: int, changes: list[str], conversation: bool,
              end_of_turn: bool) -> dict[str, Any]:
    config = parse_pipeline_config(configured(changes))
    await asyncio.to_thread(prepare_lm, lm_source("packaged"))
    started = time.perf_counter()
    coordinator = await start_pipeline(config, mode=mode)
    start_s = time.perf_counter() - started
    try:
        await ask(coordinator, "warmup", "Hello there.")
        await coordinator.stage_stats()
        before = step_totals()
        turns: list[Turn] = []
        history: list[dict[str, Any]] = []
        for r in range(rounds):
            for i, question in enumerate(QUESTIONS):
                turns.append(await ask(coordinator, f"q{r}-{i}", question, history, end_of_turn))
                if conversation:  # the next question continues this conversation
                    history += [{"role": "user", "text": turns[-1].transcript},
                                {"role": "assistant", "text": turns[-1].text}]
        await asyncio.sleep(0.5)  # the stages' last periodic reports carry their last steps
        await coordinator.stage_stats()
        after = step_totals()
    finally:
        await coordinator.close()
    steps = {
        s: round(1000 * (after[s][0] - before[s][0]) / max(1.0, after[s][1] - before[s][1]), 1)
        for s in STAGES
    }
    spoken = spoken_wer(turns)
    return {
        "mode": mode,
        "changes": changes,
        "conversation": conversation,
        "end_of_turn": end_of_turn,
        "machine": machine(),
        "pipeline_start_s": round(start_s, 2),
        "phases_ms": {p: percentiles([t.times[p] for t in turns]) for p in PHASES},
        "derived_ms": {
            "lm_first_token_after_transcript": percentiles(
                [t.times["first_text"] - t.times["transcript"] for t in turns]
            ),
            "first_clause_wait_after_first_text": percentiles(
                [t.times["first_clause_text"] - t.times["first_text"] for t in turns]
            ),
            "tts_first_clause": percentiles(
                [t.times["first_audio"] - t.times["first_clause_text"] for t in turns]
            ),
        },
        "step_mean_ms": steps,
        "transcript_wer_mean": round(
            float(np.mean([wer(t.question, t.transcript) for t in turns])), 3
        ),
        "spoken_answer_wer_mean": round(float(np.mean(spoken)), 3),
        "turns": [
            {
                "question": t.question,
                "transcript": t.transcript,
                "answer": t.text,
                "audio_s": round(sum(len(a) for a in t.audio) / max(t.rate, 1), 2),
                "first_clause": t.first_clause,
                "end_of_turn": t.finished,
                "spoken_wer": round(w, 3),
                "ms": {k: round(v * 1000) for k, v in t.times.items()},
            }
            for t, w in zip(turns, spoken, strict=True)
        ],
    }


def plot(results: dict[str, Any], path: Path) -> None:
    turns = results["turns"]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(turns) + 1.5))
    segments = [  # (phase it ends at, label, phase it starts at, colour)
        ("transcript", "speech recognition", None, "tab:blue"),
        ("first_text", "LM first token", "transcript", "tab:orange"),
        ("first_clause_text", "first clause text", "first_text", "tab:green"),
        ("first_audio", "synthesis of clause 1", "first_clause_text", "tab:purple"),
    ]
    for i, turn in enumerate(turns):
        ms = turn["ms"]
        for key, label, since, colour in segments:
            left = 0 if since is None else ms[since]
            ax.barh(i, ms[key] - left, left=left, color=colour, label=label if i == 0 else None)
        ax.plot([ms["done"]], [i], "k|", markersize=12, label="answer done" if i == 0 else None)
    ax.axvline(700, color="r", linestyle="--", label="target: first audio 700 ms")
    ax.set_yticks(range(len(turns)), [t["question"][:32] for t in turns])
    ax.invert_yaxis()
    ax.set_xlabel("ms after the request was submitted (end of turn)")
    ax.set_title(f"offline preset, {results['mode']} mode, {results['machine']['cpus']} CPUs")
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["process", "inproc"], default="process")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="STAGE.OPTION=VALUE")
    parser.add_argument("--name", default="offline_bench", help="results file name")
    parser.add_argument("--conversation", action="store_true",
                        help="one conversation: each question after the ones before and their answers")
    parser.add_argument("--end-of-turn", action="store_true",
                        help="each request also asks whether its words are finished")
    args = parser.parse_args()
    results = asyncio.run(run(args.mode, args.rounds, args.set, args.conversation, args.end_of_turn))
    rows = [[p, v["p50"], v["p90"]] for p, v in results["phases_ms"].items()]
    rows += [[p, v["p50"], v["p90"]] for p, v in results["derived_ms"].items()]
    print(format_table(["from submit / phase (ms)", "p50", "p90"], rows))
    print(format_table(["stage", "mean step ms"], list(results["step_mean_ms"].items())))
    print(f"transcript WER (mean): {results['transcript_wer_mean']}, spoken answers' WER (mean): "
          f"{results['spoken_answer_wer_mean']}, load: {results['machine']}")
    save_results(args.name, results, plot)


if __name__ == "__main__":
    main()
