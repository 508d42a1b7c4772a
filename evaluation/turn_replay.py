"""Replaying end-of-turn detectors on traces (:mod:`evaluation.turn_trace`): semantic_vad's policy
window by window on the model's answers, and the real server_vad detector on the audio.

Used by :mod:`evaluation.turn_eval` (measure) and :mod:`evaluation.turn_tuning` (search). Nothing
here holds state between calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from duplex.turns.config import TurnDetection
from duplex.turns.end_of_turn import TEXT_BIAS, W_TEXT
from duplex.turns.semantic_policy import (
    MIN_SILENCE_MS,
    Decision,
    Patience,
    decide,
    probability_with_words,
)
from duplex.turns.server_vad import SpeechStopped, TurnDetector
from duplex.turns.transcript_cue import Words
from duplex.turns.vad import SAMPLE_RATE, WINDOW
from evaluation.turn_trace import Trace

STEP_MS = WINDOW * 1000 // SAMPLE_RATE
Weights = tuple[float, float, float]  # (w_model, w_fall, bias) of Cues.probability
TextWeights = tuple[float, float]  # (w_text, bias) of with_text


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
    with_words: bool = False, text_weights: TextWeights = (W_TEXT, TEXT_BIAS),
) -> dict[str, Any]:
    """semantic_vad with ``rule`` and the cue ``weights`` (and the words of each pause, if
    ``with_words``: how they read and, where judged, the text term with ``text_weights``; then
    ``call_ms`` is what the slower of model and recogniser takes) over every trace; pauses inside
    a turn count as ``stretch`` times as long as they were (a margin when tuning)."""
    latencies, cut_scripted, cut_any, at_ask = [], 0, 0, 0
    for t in traces:
        cut = False
        latency = 0.0
        for pause in t.pauses:
            p = pause.cues.probability(*weights) if pause.cues else None
            words = pause.words if with_words else None
            if with_words:
                p = probability_with_words(p, words, pause.finished_text, *text_weights)
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
