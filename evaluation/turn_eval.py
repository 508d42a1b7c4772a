"""End-of-turn detection offline: semantic_vad (each eagerness) against server_vad (200 / 500 ms)
on spoken turns made at run time (:mod:`evaluation.turn_utterances`).

    python -m evaluation.turn_eval            # measure the shipped policy and model
    python -m evaluation.turn_eval --tune     # also fit the cue weights and search the policy

Where the offline model set is installed, every pause that reaches ``WORDS_AT_MS`` is also
transcribed by its recogniser (Whisper tiny.en, as the speculative request begun then does in the
server) and its words judged by the
language model the ``asr`` stage runs beside it (``finished_text``), and semantic_vad is measured
a second time with the words of the pause as a cue ("+ words"); a decision at the ask then also
waits for the recognition and the judgement.

For every turn the session's real VAD runs window by window over the audio as a streaming
detector would see it; semantic_vad asks the end-of-turn model once per pause, at
``MIN_SILENCE_MS`` of silence (:mod:`evaluation.turn_trace`), then replays
``semantic_policy.decide`` window by window on that answer. server_vad is the real
``TurnDetector`` with its silence set to 200 or 500 ms. Per detector, over the set:

- end of speech -> decision: from the last sample of the last word to the moment the turn ends
  (the VAD's lag included; a decision taken when the model answers also waits for the model's
  median call time, timed on this machine), median and p90;
- cut off: turns ended before their last word, among those with a scripted mid-sentence pause
  (an unfinished phrase, a number or list read in groups) and among all;
- ended at the ask: turns the model was sure enough about to end at its first answer.

It also reports the model's cost (ms per call, calls per minute of speech) and the AUC of each
cue. ``--tune`` (:mod:`evaluation.turn_tuning`) fits the cue weights (the text judge's too),
searches each eagerness's threshold and hold, and checks both on held-out halves; copy what it
prints into ``duplex/turns/end_of_turn.py`` and ``duplex/turns/semantic_policy.py``. Writes
``evaluation/results/turn_eval.json`` and ``.png``. Needs espeak-ng, sox and the ``pipecat-ai``
wheel (the model's weights); no network, no server.

Nothing here holds state between calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from duplex.turns.end_of_turn import (
    BIAS,
    TEXT_BIAS,
    W_FALL,
    W_MODEL,
    W_TEXT,
    shared_model,
    with_text,
)
from duplex.turns.prosody import final_pitch_fall
from duplex.turns.semantic_policy import (
    MIN_SILENCE_MS,
    WORDS_AT_MS,
    Eagerness,
    patience,
)
from duplex.turns.vad import SAMPLE_RATE
from evaluation.bench_common import format_table, machine, save_figure, save_results
from evaluation.turn_replay import TextWeights, Weights, replay, server_vad
from evaluation.turn_trace import Trace, trace
from evaluation.turn_tuning import (
    auc,
    fit_text_weights,
    fit_weights,
    held_out_check,
    tune,
    tune_all,
)
from evaluation.turn_utterances import LEAD_S, utterances

NAME = "turn_eval"
TAIL_S = 1.5  # silence after each turn: server_vad's 500 ms plus the VAD's lag fit in it
EAGERNESSES = (Eagerness.LOW, Eagerness.MEDIUM, Eagerness.HIGH)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["detectors"]
    names = list(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(names))
    left.bar(x - 0.2, [rows[n]["median_ms"] for n in names], 0.4, label="median")
    left.bar(x + 0.2, [rows[n]["p90_ms"] for n in names], 0.4, label="p90")
    for i, n in enumerate(names):
        left.annotate(f"cut {rows[n]['cut_scripted']}", (i, rows[n]["p90_ms"]), ha="center",
                      va="bottom", fontsize=8)
    left.set_xticks(x, names, rotation=20, fontsize=8)
    left.set_ylabel("end of speech -> decision (ms)")
    left.set_title("Turn end latency (cut = turns ended inside a scripted pause)")
    left.legend()
    scores = results["pause_scores"]
    bins = np.linspace(0, 1, 21)
    right.hist(scores["finished"], bins, alpha=0.6, label="end of a finished turn")
    right.hist(scores["inside"], bins, alpha=0.6, label="pause inside a turn")
    right.set_xlabel("P(complete) when the model is asked")
    right.set_title("End-of-turn probability per pause")
    right.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tune", action="store_true", help="fit the weights, search the policy")
    args = parser.parse_args()

    model = shared_model()
    started = time.perf_counter()
    turns = utterances(TAIL_S)
    print(f"{len(turns)} turns synthesized in {time.perf_counter() - started:.1f} s")
    hear, judge = _recogniser()
    traces = [trace(u, model, MIN_SILENCE_MS, hear, judge, WORDS_AT_MS) for u in turns]
    calls = [s * 1000 for t in traces for s in t.call_seconds]
    heard = [s * 1000 for t in traces for s in t.hear_seconds]
    timing = _model_timing(model, turns[0].audio)
    # What a decision taken at the ask waits for: the model's own cost, timed apart from the
    # traces, where it shares the cores with the VAD loop and the synthesis.
    call_ms = timing["smart_turn"] + timing["pitch_fall"]
    # With the words, the decision at the ask waits for the slower of the model and the
    # recogniser (they run side by side: the model in the session, recognition in the pipeline,
    # asked for sooner, at WORDS_AT_MS).
    words_ask_ms = (max(call_ms, WORDS_AT_MS + statistics.median(heard) - MIN_SILENCE_MS)
                    if heard else call_ms)

    weights: Weights = (W_MODEL, W_FALL, BIAS)
    text_weights: TextWeights = (W_TEXT, TEXT_BIAS)
    rules = {e: patience(e) for e in EAGERNESSES}
    if args.tune:
        weights = fit_weights(traces, W_MODEL)
        rules = tune_all(traces, weights, call_ms)
        print(f"fitted weights (w_model, w_fall, bias) = {weights}")
        if heard:
            text_weights = fit_text_weights(traces, weights)
            print(f"fitted text weights (w_text, bias) = {text_weights}")
        for e, rule in rules.items():
            print(f"tuned {e}: {rule}")
        held_out_check(traces, weights, call_ms, words_ask_ms if heard else None)

    detectors: dict[str, dict[str, Any]] = {}
    for e, rule in rules.items():
        detectors[f"semantic_vad {e}"] = replay(traces, rule, weights, call_ms)
        if heard:
            detectors[f"semantic_vad {e} + words"] = replay(
                traces, rule, weights, words_ask_ms, with_words=True, text_weights=text_weights)
    # What-if, refitted and retuned on every run: the pitch cue alone, without smart-turn.
    pitch_only = fit_weights(traces, 0.0)
    detectors["semantic medium, pitch only"] = replay(
        traces, tune(traces, Eagerness.MEDIUM, pitch_only, call_ms), pitch_only, call_ms)
    for silence in (200, 500):
        detectors[f"server_vad {silence} ms"] = server_vad(traces, silence)

    speech_minutes = sum(t.utterance.speech_end_ms - LEAD_S * 1000 for t in traces) / 60_000
    results = {
        "machine": machine(),
        "turns": len(traces),
        "weights": dict(zip(("w_model", "w_fall", "bias"), weights)),
        "text_weights": dict(zip(("w_text", "bias"), text_weights)),
        "policy": {str(e): dataclasses.asdict(r) for e, r in rules.items()},
        "min_silence_ms": MIN_SILENCE_MS,
        "words_at_ms": WORDS_AT_MS,
        "auc": {
            "smart_turn": auc(traces, lambda p: p.cues.smart_turn),
            "pitch_fall": auc(traces, lambda p: -(p.cues.pitch_fall or 0.0)),
            "combined": auc(traces, lambda p: p.cues.probability(*weights)),
            **({
                "text": auc(traces, lambda p: p.finished_text or 0.0),
                "with_text": auc(traces, lambda p: with_text(
                    p.cues.probability(*weights), p.finished_text, *text_weights)),
            } if judge else {}),
        },
        "model_ms": {
            **timing,
            "in_trace_call_median": round(statistics.median(calls), 1),
            "in_trace_call_p90": round(float(np.percentile(calls, 90)), 1),
        },
        "calls_per_speech_minute": round(len(calls) / speech_minutes, 1),
        "recognition_ms": {
            "median": round(statistics.median(heard), 1) if heard else None,
            "p90": round(float(np.percentile(heard, 90)), 1) if heard else None,
        },
        "words": _words_table(traces) if heard else None,
        "detectors": detectors,
        "pause_scores": {
            "finished": [p.cues.probability(*weights) for t in traces for p in t.pauses
                         if p.cues and not p.inside],
            "inside": [p.cues.probability(*weights) for t in traces for p in t.pauses
                       if p.cues and p.inside],
        },
    }
    print(format_table(
        ["detector", "median ms", "p90 ms", "cut (scripted pauses)", "cut (any)",
         "ended at the ask"],
        [[n, d["median_ms"], d["p90_ms"], d["cut_scripted"], d["cut_any"], d.get("at_ask")]
         for n, d in detectors.items()],
    ))
    print(f"\nAUC finished vs mid-turn pause: {results['auc']}")
    if heard:
        print(f"words of the asked pauses: {results['words']}; recognition "
              f"{results['recognition_ms']} ms")
    print(f"model: {results['model_ms']} ms; {results['calls_per_speech_minute']} calls per minute "
          f"of speech ({len(calls)} calls over {speech_minutes:.1f} min)")
    save_results(NAME, results, plot)


def _recogniser() -> tuple[Callable[[np.ndarray], str] | None, Callable[[str], float] | None]:
    """The offline preset's Whisper tiny.en on 16 kHz audio and the text end-of-turn judge its
    ``asr`` stage runs beside it, or None where they are not installed."""
    try:
        from pipeline.models.offline.asr import Transcriber
        from pipeline.models.offline.finished_text import FinishedText
        from pipeline.models.offline.sources import asr_model_dir

        transcriber = Transcriber(asr_model_dir("packaged"))
        judge = FinishedText()
    except (ImportError, RuntimeError) as err:
        print(f"no recogniser ({err}): semantic_vad is measured on audio cues only")
        return None, None
    return (lambda audio: transcriber.transcribe(audio, SAMPLE_RATE)), judge.probability


def _words_table(traces: list[Trace]) -> dict[str, dict[str, int]]:
    """How the words of each asked pause read, at the end of a turn and inside one."""
    table: dict[str, dict[str, int]] = {"finished": {}, "inside": {}}
    for pause in (p for t in traces for p in t.pauses if p.words is not None):
        row = table["inside" if pause.inside else "finished"]
        row[str(pause.words)] = row.get(str(pause.words), 0) + 1
    return table


def _model_timing(model: Any, audio: np.ndarray, repeats: int = 20) -> dict[str, float]:
    """Median ms of each part of a call, on one turn's audio."""
    def median_ms(f: Any) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            f(audio)
            times.append(time.perf_counter() - started)
        return round(statistics.median(times) * 1000, 1)

    return {"smart_turn": median_ms(model.smart_turn), "pitch_fall": median_ms(final_pitch_fall)}


if __name__ == "__main__":
    main()
