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
   cannot end a sentence hold the turn until the maximum wait, and words that read as finished
   bring in the pipeline's own judgement of them, where it makes one (a language model's
   P(finished), ``input_end_of_turn``; asked for at ``WORDS_AT_MS``, sooner than the model, so
   that they are in when a decision may fall): it joins the audio's probability
   (:func:`probability_with_words`) and, when sure, ends the turn at the first ask. Words that
   read as neither (numbers and codes, read in groups) add nothing.

The numbers are tuned by ``python -m evaluation.turn_eval --tune`` on its spoken set: the
smallest median end-of-speech -> decision time with no decision inside any mid-sentence pause,
even were those pauses 30% longer. (A lower bar and an earlier fall for finished words, searched
the same way on top of the text term, ended no turn sooner: the term is the words' whole effect.)

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

from duplex.turns.end_of_turn import TEXT_BIAS, W_TEXT, with_text
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

# 3 windows: the words (recognised and judged by the speculative request the session begins then,
# ~100-150 ms) are asked for this early so that they are in by about when the model answers, and
# the answer begun then has that much of a head start. (The model itself keeps its ask: it was
# tuned on 192 ms of trailing silence, and with 96 it scores finished sentences lower.) Pauses this
# long inside a turn are few beyond the mid-sentence pauses the policy waits through anyway
# (evaluation/turn_eval.py's spoken set: 77 pauses reach 96 ms, 69 reach 192 ms, in 144 turns): few
# answers are begun and withdrawn for it.
WORDS_AT_MS = 96

MAX_WAIT_MS = {Eagerness.LOW: 8000, Eagerness.MEDIUM: 4000, Eagerness.HIGH: 2000}


@dataclass(frozen=True)
class Patience:
    """How sure the detector must be, and from when that bar falls (see module doc)."""

    threshold: float  # P(complete) that ends the turn as soon as the model has answered
    hold_ms: int  # silence until which the bar stays at ``threshold``
    max_wait_ms: int  # silence at which the turn ends regardless; the bar reaches 0 here

    def required(self, silence_ms: int) -> float:
        """The probability that ends the turn after ``silence_ms`` of silence."""
        if silence_ms <= self.hold_ms:
            return self.threshold
        fall = (silence_ms - self.hold_ms) / (self.max_wait_ms - self.hold_ms)
        return self.threshold * max(0.0, 1.0 - fall)


# The search gave every eagerness the same bar and hold; what differs is how soon the bar reaches
# zero. 1216 ms: longer than the set's mid-sentence pauses by the search's margin of 30%.
PATIENCE = {
    eagerness: Patience(threshold=0.94, hold_ms=1216, max_wait_ms=max_wait)
    for eagerness, max_wait in MAX_WAIT_MS.items()
}


def patience(eagerness: Eagerness | str) -> Patience:
    """The tuned :class:`Patience` of an eagerness (``auto`` is ``medium``)."""
    eagerness = Eagerness(eagerness)
    return PATIENCE[Eagerness.MEDIUM if eagerness is Eagerness.AUTO else eagerness]


def probability_with_words(
    p_audio: float | None, words: Words | None, finished_text: float | None,
    w_text: float = W_TEXT, bias: float = TEXT_BIAS,
) -> float | None:
    """The probability the policy weighs: the audio's, joined by the pipeline's judgement of the
    words (``finished_text``) where they read as finished (module doc, rule 4). None while the
    audio model has not answered. The weights are parameters for tuning."""
    if p_audio is None:
        return None
    return with_text(p_audio, finished_text if words is Words.COMPLETE else None, w_text, bias)


def decide(
    p_complete: float | None,
    silence_ms: int,
    eagerness: Eagerness | str = Eagerness.AUTO,
    rule: Patience | None = None,
    words: Words | None = None,
) -> Decision:
    """End the turn or wait, ``silence_ms`` into a pause whose end-of-turn probability is
    ``p_complete`` (None while the model has not answered yet; :func:`probability_with_words`
    once the words are in) and whose words read as ``words`` (None while unknown). ``rule`` replaces the eagerness's tuned :class:`Patience` (the
    evaluation tries others)."""
    rule = rule or patience(eagerness)
    if silence_ms < MIN_SILENCE_MS:
        return Decision.WAIT
    if silence_ms >= rule.max_wait_ms:
        return Decision.END
    if words is Words.INCOMPLETE:
        return Decision.WAIT
    if p_complete is not None and p_complete >= rule.required(silence_ms):
        return Decision.END
    return Decision.WAIT
