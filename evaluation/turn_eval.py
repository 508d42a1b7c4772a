"""End-of-turn detection offline: semantic_vad (each eagerness) against server_vad (200 / 500 ms)
on spoken turns made at run time (:mod:`evaluation.turn_utterances`).

    python -m evaluation.turn_eval            # measure the shipped policy and model
    python -m evaluation.turn_eval --tune     # also fit the cue weights and search the policy

Where the offline model set is installed, every asked pause is also transcribed by its recogniser
(Whisper tiny.en, as the speculative request does in the server) and semantic_vad is measured a
second time with the words of the pause as a cue ("+ words"); a decision at the ask then also
waits for the recognition.

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
cue. ``--tune`` fits the cue weights, searches each eagerness's threshold and hold, and checks the
search on held-out halves of the set; copy what it prints into ``duplex/turns/end_of_turn.py`` and
``duplex/turns/semantic_policy.py``. Writes
``evaluation/results/turn_eval.json`` and ``.png``. Needs espeak-ng, sox and the ``pipecat-ai``
wheel (the model's weights); no network, no server.

Nothing here holds state between calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from duplex.turns.config import TurnDetection
from duplex.turns.end_of_turn import BIAS, W_FALL, W_MODEL, Cues, shared_model
from duplex.turns.prosody import final_pitch_fall
from duplex.turns.semantic_policy import (
    MAX_WAIT_MS,
    MIN_SILENCE_MS,
    Decision,
    Eagerness,
    Patience,
    decide,
    patience,
)
from duplex.turns.server_vad import SpeechStopped, TurnDetector
from duplex.turns.transcript_cue import Words
from duplex.turns.vad import SAMPLE_RATE, WINDOW
from evaluation.bench_common import format_table, machine, save_results
from evaluation.turn_trace import Trace, trace
from evaluation.turn_utterances import LEAD_S, utterances

NAME = "turn_eval"
TAIL_S = 1.5  # silence after each turn: server_vad's 500 ms plus the VAD's lag fit in it
STEP_MS = WINDOW * 1000 // SAMPLE_RATE
MARGIN = 1.3  # tuning keeps clear of pauses 30% longer than the set's
EAGERNESSES = (Eagerness.LOW, Eagerness.MEDIUM, Eagerness.HIGH)
Weights = tuple[float, float, float]  # (w_model, w_fall, bias) of Cues.probability


def _decision_ms(
    p: float | None, length_ms: int | None, rule: Patience, call_ms: float,
    words: Words | None = None,
) -> float | None:
    """When in a pause (ms of silence) the policy ends the turn, replayed window by window; None
    when the pause ends first. ``length_ms`` None: the pause lasts until the turn ends."""
    silence = MIN_SILENCE_MS
    while length_ms is None or silence <= length_ms:
        if decide(p, silence, rule=rule, words=words) is Decision.END:
            # Ending as soon as the model was asked also waits for its answer.
            return silence + call_ms if silence == MIN_SILENCE_MS else silence
        silence += STEP_MS
    return None


def replay(
    traces: list[Trace], rule: Patience, weights: Weights, call_ms: float, stretch: float = 1.0,
    with_words: bool = False,
) -> dict[str, Any]:
    """semantic_vad with ``rule`` and the cue ``weights`` (and the words of each pause, if
    ``with_words``: then ``call_ms`` is what the slower of model and recogniser takes) over every
    trace; pauses inside a turn count as ``stretch`` times as long as they were (a margin when
    tuning)."""
    latencies, cut_scripted, cut_any, at_ask = [], 0, 0, 0
    for t in traces:
        cut = False
        latency = 0.0
        for pause in t.pauses:
            p = pause.cues.probability(*weights) if pause.cues else None
            words = pause.words if with_words else None
            if pause.inside:
                # An answer that comes after the speaker went on is dropped by the detector.
                length = round(pause.length_ms * stretch)
                ended = _decision_ms(p, length, rule, call_ms, words)
                cut |= ended is not None and ended <= length
            else:
                decided = _decision_ms(p, None, rule, call_ms, words)
                at_ask += decided == MIN_SILENCE_MS + call_ms
                latency = pause.start_ms + decided - t.utterance.speech_end_ms
        latencies.append(latency)
        cut_any += cut
        cut_scripted += cut and t.utterance.pauses > 0
    summary = _summary(latencies, cut_scripted, cut_any, traces)
    return {**summary, "at_ask": f"{at_ask}/{len(traces)}"}


def server_vad(traces: list[Trace], silence_ms: int) -> dict[str, Any]:
    """The real server_vad detector with ``silence_ms`` over every turn's audio."""
    latencies, cut_scripted, cut_any = [], 0, 0
    for t in traces:
        u = t.utterance
        detector = TurnDetector(TurnDetection(silence_duration_ms=silence_ms))
        stops = [e for e in detector.process(u.audio) if isinstance(e, SpeechStopped)]
        cut = any(e.end_ms < u.speech_end_ms for e in stops)
        final = [e.end_ms for e in stops if e.end_ms >= u.speech_end_ms]
        latencies.append(final[0] - u.speech_end_ms)
        cut_any += cut
        cut_scripted += cut and u.pauses > 0
    return _summary(latencies, cut_scripted, cut_any, traces)


def _summary(
    latencies: list[float], cut_scripted: int, cut_any: int, traces: list[Trace]
) -> dict[str, Any]:
    """``latencies`` holds one value per trace, in order."""
    scripted = sum(t.utterance.pauses > 0 for t in traces)
    kinds = sorted({t.utterance.kind for t in traces})
    return {
        "median_ms": round(float(np.median(latencies))),
        "p90_ms": round(float(np.percentile(latencies, 90))),
        "cut_scripted": f"{cut_scripted}/{scripted}",
        "cut_any": f"{cut_any}/{len(traces)}",
        "cut_count": cut_any,
        "median_ms_by_kind": {
            kind: round(float(np.median(
                [v for v, t in zip(latencies, traces) if t.utterance.kind == kind]
            )))
            for kind in kinds
        },
    }


def fit_weights(traces: list[Trace], w_model: float) -> Weights:
    """Logistic regression of "finished" on the pitch fall (plus ``w_model`` times smart-turn's
    logit as a fixed offset), over every pause the model was asked about."""
    rows = [(p.cues, not p.inside) for t in traces for p in t.pauses if p.cues]
    offset = np.array([w_model * _logit(c.smart_turn) for c, _ in rows])
    x = np.column_stack([[c.pitch_fall or 0.0 for c, _ in rows], np.ones(len(rows))])
    y = np.array([float(finished) for _, finished in rows])
    w = np.zeros(2)
    for _ in range(50):  # Newton's method, lightly ridged: separable data must not diverge
        p = 1 / (1 + np.exp(-(x @ w + offset)))
        gradient = x.T @ (p - y) + 0.1 * w * [1, 0]
        hessian = x.T @ (x * (p * (1 - p))[:, None]) + 0.1 * np.diag([1, 0])
        w -= np.linalg.solve(hessian, gradient)
    return (w_model, round(float(w[0]), 2), round(float(w[1]), 2))


def _logit(p: float) -> float:
    p = min(max(p, 1e-3), 1 - 1e-3)  # as Cues.probability clips it
    return math.log(p / (1 - p))


def auc(traces: list[Trace], score: Callable[[Cues], float]) -> float:
    """P(a finished turn's pause scores above a mid-sentence one), ties half."""
    finished = [score(p.cues) for t in traces for p in t.pauses if p.cues and not p.inside]
    inside = [score(p.cues) for t in traces for p in t.pauses if p.cues and p.inside]
    wins = sum((a > b) + 0.5 * (a == b) for a in finished for b in inside)
    return round(wins / (len(finished) * len(inside)), 3)


def tune(
    traces: list[Trace], eagerness: Eagerness, weights: Weights, call_ms: float,
    above: Patience | None = None,
) -> Patience:
    """The threshold and hold with the smallest median latency (then p90) that cut no turn, even
    were every pause inside a turn ``MARGIN`` times longer (tuned at the edge, half the set's
    rules cut turns in the other half). The bar must stay at or above ``above``'s at every
    silence, so that a lower eagerness is never the quicker to answer."""
    best: tuple[float, float, Patience] | None = None
    # Holds past ~2 s only make the doubtful turns slower: mid-sentence pauses are shorter.
    for threshold in np.arange(0.5, 0.99, 0.02):
        for hold in range(MIN_SILENCE_MS, min(MAX_WAIT_MS[eagerness], 2048), 4 * STEP_MS):
            rule = Patience(round(float(threshold), 2), hold, MAX_WAIT_MS[eagerness])
            if not _ordered(above, rule):
                continue
            result = replay(traces, rule, weights, call_ms, stretch=MARGIN)
            key = (result["median_ms"], result["p90_ms"])
            if result["cut_count"] == 0 and (best is None or key < best[:2]):
                best = (*key, rule)
    assert best is not None, f"every {eagerness} rule tried cuts a turn"
    return best[2]


def tune_all(traces: list[Trace], weights: Weights, call_ms: float) -> dict[Eagerness, Patience]:
    """High first (its short maximum wait leaves it the least room), then medium no more eager
    than high, then low no more eager than medium."""
    high = tune(traces, Eagerness.HIGH, weights, call_ms)
    medium = tune(traces, Eagerness.MEDIUM, weights, call_ms, above=high)
    low = tune(traces, Eagerness.LOW, weights, call_ms, above=medium)
    return {Eagerness.LOW: low, Eagerness.MEDIUM: medium, Eagerness.HIGH: high}


def tune_words_threshold(traces: list[Trace], rules: dict[Eagerness, Patience], weights: Weights,
                         ask_ms: float) -> float:
    """The lowest bar for words that read as finished (in steps of 0.02) with which no eagerness
    cuts a turn, even were every pause inside a turn ``MARGIN`` times longer."""
    for threshold in np.arange(0.5, 1.0, 0.02):
        tried = {e: dataclasses.replace(r, words_threshold=round(float(threshold), 2))
                 for e, r in rules.items()}
        if all(replay(traces, r, weights, ask_ms, stretch=MARGIN, with_words=True)["cut_count"] == 0
               for r in tried.values()):
            return round(float(threshold), 2)
    return 1.0


def _ordered(eager: Patience | None, patient: Patience) -> bool:
    """Whether ``patient`` asks for at least ``eager``'s probability at every silence."""
    if eager is None:
        return True
    silences = range(MIN_SILENCE_MS, patient.max_wait_ms, STEP_MS)
    return all(patient.required(s) >= eager.required(s) for s in silences)


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tune", action="store_true", help="fit the weights, search the policy")
    args = parser.parse_args()

    model = shared_model()
    started = time.perf_counter()
    turns = utterances(TAIL_S)
    print(f"{len(turns)} turns synthesized in {time.perf_counter() - started:.1f} s")
    hear = _recogniser()
    traces = [trace(u, model, MIN_SILENCE_MS, hear) for u in turns]
    calls = [s * 1000 for t in traces for s in t.call_seconds]
    heard = [s * 1000 for t in traces for s in t.hear_seconds]
    timing = _model_timing(model, turns[0].audio)
    # What a decision taken at the ask waits for: the model's own cost, timed apart from the
    # traces, where it shares the cores with the VAD loop and the synthesis.
    call_ms = timing["smart_turn"] + timing["pitch_fall"]
    # With the words, the decision at the ask waits for the slower of the model and the
    # recogniser (they run side by side: the model in the session, recognition in the pipeline).
    words_ask_ms = max(call_ms, statistics.median(heard)) if heard else call_ms

    weights: Weights = (W_MODEL, W_FALL, BIAS)
    rules = {e: patience(e) for e in EAGERNESSES}
    if args.tune:
        weights = fit_weights(traces, W_MODEL)
        rules = tune_all(traces, weights, call_ms)
        print(f"fitted weights (w_model, w_fall, bias) = {weights}")
        if heard:
            words_threshold = tune_words_threshold(traces, rules, weights, words_ask_ms)
            rules = {e: dataclasses.replace(r, words_threshold=words_threshold)
                     for e, r in rules.items()}
        for e, rule in rules.items():
            print(f"tuned {e}: {rule}")
        _held_out_check(traces, weights, call_ms)

    detectors: dict[str, dict[str, Any]] = {}
    for e, rule in rules.items():
        detectors[f"semantic_vad {e}"] = replay(traces, rule, weights, call_ms)
        if heard:
            detectors[f"semantic_vad {e} + words"] = replay(traces, rule, weights, words_ask_ms,
                                                           with_words=True)
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
        "policy": {str(e): dataclasses.asdict(r) for e, r in rules.items()},
        "min_silence_ms": MIN_SILENCE_MS,
        "auc": {
            "smart_turn": auc(traces, lambda c: c.smart_turn),
            "pitch_fall": auc(traces, lambda c: -(c.pitch_fall or 0.0)),
            "combined": auc(traces, lambda c: c.probability(*weights)),
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


def _recogniser() -> Callable[[np.ndarray], str] | None:
    """The offline preset's Whisper tiny.en on 16 kHz audio, or None where it is not installed."""
    try:
        from pipeline.models.offline.asr import Transcriber
        from pipeline.models.offline.sources import asr_model_dir

        transcriber = Transcriber(asr_model_dir("packaged"))
    except (ImportError, RuntimeError) as err:
        print(f"no recogniser ({err}): semantic_vad is measured on audio cues only")
        return None
    return lambda audio: transcriber.transcribe(audio, SAMPLE_RATE)


def _words_table(traces: list[Trace]) -> dict[str, dict[str, int]]:
    """How the words of each asked pause read, at the end of a turn and inside one."""
    table: dict[str, dict[str, int]] = {"finished": {}, "inside": {}}
    for pause in (p for t in traces for p in t.pauses if p.words is not None):
        row = table["inside" if pause.inside else "finished"]
        row[str(pause.words)] = row.get(str(pause.words), 0) + 1
    return table


def _held_out_check(traces: list[Trace], weights: Weights, call_ms: float) -> None:
    """Tune on half the scripts, measure on the other half (each script is two turns in a row):
    how much of the result is fitted to the set."""
    halves = [traces[i::4] + traces[i + 1 :: 4] for i in (0, 2)]
    for tuned_on, measured_on in (halves, halves[::-1]):
        for e, rule in tune_all(tuned_on, weights, call_ms).items():
            result = replay(measured_on, rule, weights, call_ms)
            print(f"held-out {e}: median {result['median_ms']} ms, p90 {result['p90_ms']} ms, "
                  f"cut {result['cut_scripted']} scripted, {result['cut_any']} any")


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
