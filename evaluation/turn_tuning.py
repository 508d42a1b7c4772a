"""Fitting semantic_vad to the evaluation set: the cue weights (logistic regressions: the audio
cues', then the text judge's on top), each eagerness's threshold and hold, searched for the
quickest answers that cut no turn; and a check of that search on held-out halves of the set.

``python -m evaluation.turn_eval --tune`` runs it. Nothing here holds state between calls.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from duplex.turns.end_of_turn import logit
from duplex.turns.semantic_policy import MAX_WAIT_MS, MIN_SILENCE_MS, Eagerness, Patience
from duplex.turns.transcript_cue import Words
from evaluation.turn_replay import STEP_MS, TextWeights, Weights, replay
from evaluation.turn_trace import Pause, Trace

MARGIN = 1.3  # tuning keeps clear of pauses 30% longer than the set's


def fit_weights(traces: list[Trace], w_model: float) -> Weights:
    """Logistic regression of "finished" on the pitch fall (plus ``w_model`` times smart-turn's
    logit as a fixed offset), over every pause the model was asked about."""
    rows = [(p.cues, not p.inside) for t in traces for p in t.pauses if p.cues]
    offset = np.array([w_model * logit(c.smart_turn) for c, _ in rows])
    x = np.column_stack([[c.pitch_fall or 0.0 for c, _ in rows], np.ones(len(rows))])
    w = _logistic(x, np.array([float(finished) for _, finished in rows]), offset)
    return (w_model, round(float(w[0]), 2), round(float(w[1]), 2))


def fit_text_weights(traces: list[Trace], weights: Weights) -> TextWeights:
    """Logistic regression of "finished" on the text judge's logit, with the audio cues' logit
    (``weights``) as a fixed offset, over every asked pause where the policy uses the judgement
    (words judged that read as finished: ``semantic_policy.probability_with_words``)."""
    rows = [(p.cues, p.finished_text, not p.inside) for t in traces for p in t.pauses
            if p.cues and p.finished_text is not None and p.words is Words.COMPLETE]
    offset = np.array([logit(c.probability(*weights)) for c, _, _ in rows])
    x = np.column_stack([[logit(text) for _, text, _ in rows], np.ones(len(rows))])
    w = _logistic(x, np.array([float(finished) for _, _, finished in rows]), offset)
    return (round(float(w[0]), 2), round(float(w[1]), 2))


def _logistic(x: np.ndarray, y: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The weights of ``P(y) = sigmoid(x @ w + offset)`` for x's columns (a feature, then ones).
    Newton's method, the feature's weight lightly ridged: separable data must not diverge."""
    w = np.zeros(2)
    for _ in range(50):
        p = 1 / (1 + np.exp(-(x @ w + offset)))
        gradient = x.T @ (p - y) + 0.1 * w * [1, 0]
        hessian = x.T @ (x * (p * (1 - p))[:, None]) + 0.1 * np.diag([1, 0])
        w -= np.linalg.solve(hessian, gradient)
    return w


def auc(traces: list[Trace], score: Callable[[Pause], float]) -> float:
    """P(a finished turn's asked pause scores above a mid-sentence one), ties half."""
    asked = [p for t in traces for p in t.pauses if p.cues]
    finished = [score(p) for p in asked if not p.inside]
    inside = [score(p) for p in asked if p.inside]
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


def _ordered(eager: Patience | None, patient: Patience) -> bool:
    """Whether ``patient`` asks for at least ``eager``'s probability at every silence."""
    if eager is None:
        return True
    silences = range(MIN_SILENCE_MS, patient.max_wait_ms, STEP_MS)
    return all(patient.required(s) >= eager.required(s) for s in silences)


def held_out_check(traces: list[Trace], weights: Weights, call_ms: float,
                   ask_ms: float | None = None) -> None:
    """Tune on half the scripts, measure on the other half: how much of the result is fitted to
    the set. With ``ask_ms`` (the words are known) the text judge's weights too."""
    scripts = sorted({t.utterance.text for t in traces})
    halves = [[t for t in traces if scripts.index(t.utterance.text) % 2 == i] for i in (0, 1)]
    for tuned_on, measured_on in (halves, halves[::-1]):
        rules = tune_all(tuned_on, weights, call_ms)
        for e, rule in rules.items():
            _print_held_out(str(e), replay(measured_on, rule, weights, call_ms))
        if ask_ms is None:
            continue
        text_weights = fit_text_weights(tuned_on, weights)
        for e, rule in rules.items():
            _print_held_out(f"{e} + words", replay(measured_on, rule, weights, ask_ms,
                                                   with_words=True, text_weights=text_weights))


def _print_held_out(name: str, result: dict[str, object]) -> None:
    print(f"held-out {name}: median {result['median_ms']} ms, p90 {result['p90_ms']} ms, "
          f"cut {result['cut_scripted']} scripted, {result['cut_any']} any")
