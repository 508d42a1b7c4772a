"""semantic_vad's decision rule: given P(the user has finished) and the silence so far, end the
turn now or wait.

OpenAI's ``semantic_vad`` takes an ``eagerness`` (``low``, ``medium``, ``high``; ``auto`` is
``medium``) that trades speed for patience, with a maximum wait of 8, 4 and 2 s. Here:

1. Below ``MIN_SILENCE_MS`` of silence nothing is decided: that is when the detector asks the
   end-of-turn model, once per pause, on the turn's audio up to that point.
2. At ``MAX_WAIT_MS[eagerness]`` of silence the turn ends whatever the model said.
3. In between, the turn ends once ``p_complete`` reaches the required probability: the
   eagerness's ``threshold`` until ``hold_ms`` of silence, then falling linearly to 0 at the
   maximum wait. A confident answer ends the turn at once; a doubtful one only once the pause has
   outlasted the mid-sentence pauses of the tuning set (~1 s, the hold), and then the sooner the
   likelier it is.
4. Where the words of the turn so far are known (:mod:`duplex.turns.transcript_cue`), words that
   read as finished cap the bar at ``words_threshold`` and start its fall at ``words_hold_ms``
   (sooner: a finished sentence seldom goes on after a long pause), and words that cannot end a
   sentence hold the turn until the maximum wait.

The numbers are tuned by ``python -m evaluation.turn_eval --tune`` on its spoken set: the
smallest median end-of-speech -> decision time with no decision inside any mid-sentence pause,
even were those pauses 30% longer.

A streaming detector uses it window by window, during a turn:

- when the VAD's silence first reaches ``MIN_SILENCE_MS`` in a pause, it hands the turn's audio
  so far (trailing silence included) to ``EndOfTurnModel.probability`` off the event loop;
- on every window of the pause it calls ``decide(p, silence_ms, eagerness)``, with ``p`` None
  until the answer is back, and ends the turn on ``END``;
- when speech resumes, the pause is over: it forgets ``p`` (an answer still on its way is
  dropped) and asks again in the next pause.

Nothing here holds state; the caller keeps the pause's probability and silence.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from duplex.turns.transcript_cue import Words


class Eagerness(enum.StrEnum):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    AUTO = "auto"  # OpenAI's default; behaves as MEDIUM


class Decision(enum.StrEnum):
    END = "end"
    WAIT = "wait"


# 6 VAD windows of 32 ms: the VAD's own lag already puts ~60-100 ms between the last sound and
# the start of the silence count, so the model is asked ~300 ms after the real end of speech.
MIN_SILENCE_MS = 192

MAX_WAIT_MS = {Eagerness.LOW: 8000, Eagerness.MEDIUM: 4000, Eagerness.HIGH: 2000}


@dataclass(frozen=True)
class Patience:
    """How sure the detector must be, and from when that bar falls (see module doc)."""

    threshold: float  # P(complete) that ends the turn as soon as the model has answered
    hold_ms: int  # silence until which the bar stays at ``threshold``
    max_wait_ms: int  # silence at which the turn ends regardless; the bar reaches 0 here
    words_threshold: float = 0.88  # the bar's cap when the words read as finished (see below)
    words_hold_ms: int = 1088  # and from when the bar falls then, if sooner than ``hold_ms``

    def required(self, silence_ms: int, words: Words | None = None) -> float:
        """The probability that ends the turn after ``silence_ms`` of silence, given what the
        words of the turn so far say (None: not known; INCOMPLETE words wait for the maximum)."""
        finished = words is Words.COMPLETE
        hold = min(self.hold_ms, self.words_hold_ms) if finished else self.hold_ms
        if silence_ms <= hold:
            bar = self.threshold
        else:
            bar = self.threshold * max(0.0, 1.0 - (silence_ms - hold) / (self.max_wait_ms - hold))
        return min(bar, self.words_threshold) if finished else bar


# The search gave every eagerness the same bar and hold; what differs is how soon the bar reaches
# zero. 1088 ms: longer than the set's mid-sentence pauses by the search's margin of 30%. With
# finished words, the bar of medium (and low, which must not be the quicker) starts falling at
# 640 ms; high's steep fall (to zero at 2 s) cuts mid-sentence pauses if it starts before 1088 ms.
WORDS_HOLD_MS = {Eagerness.LOW: 640, Eagerness.MEDIUM: 640, Eagerness.HIGH: 1088}
PATIENCE = {
    eagerness: Patience(threshold=0.92, hold_ms=1088, max_wait_ms=max_wait, words_threshold=0.88,
                        words_hold_ms=WORDS_HOLD_MS[eagerness])
    for eagerness, max_wait in MAX_WAIT_MS.items()
}


def patience(eagerness: Eagerness | str) -> Patience:
    """The tuned :class:`Patience` of an eagerness (``auto`` is ``medium``)."""
    eagerness = Eagerness(eagerness)
    return PATIENCE[Eagerness.MEDIUM if eagerness is Eagerness.AUTO else eagerness]


def decide(
    p_complete: float | None,
    silence_ms: int,
    eagerness: Eagerness | str = Eagerness.AUTO,
    rule: Patience | None = None,
    words: Words | None = None,
) -> Decision:
    """End the turn or wait, ``silence_ms`` into a pause whose end-of-turn probability is
    ``p_complete`` (None while the model has not answered yet) and whose words read as ``words``
    (None while unknown). ``rule`` replaces the eagerness's tuned :class:`Patience` (the
    evaluation tries others)."""
    rule = rule or patience(eagerness)
    if silence_ms < MIN_SILENCE_MS:
        return Decision.WAIT
    if silence_ms >= rule.max_wait_ms:
        return Decision.END
    if words is Words.INCOMPLETE:
        return Decision.WAIT
    if p_complete is not None and p_complete >= rule.required(silence_ms, words):
        return Decision.END
    return Decision.WAIT
