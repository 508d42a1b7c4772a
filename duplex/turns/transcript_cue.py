"""The words of a pause: whether the transcript of the user's turn so far reads as finished.

semantic_vad hears intonation (:mod:`duplex.turns.end_of_turn`); where the model pipeline
recognises speech (the ``offline`` preset's ``asr`` stage), a speculative response started at the
pause brings back the transcript of the turn so far (:mod:`duplex.session.speculation`), and its
last words say what audio cannot: "I would like a large pizza and" has not finished however its
pitch falls. Most of what words say needs a language model (the pipeline's text judge,
``input_end_of_turn``: "...from Boston to" is unfinished, "Where are you from?" is not); the rules
here are the few that need none.

:func:`read_transcript` sorts a transcript into three kinds, by rules that hold for English:

- ``INCOMPLETE``: it ends in a word that cannot end a sentence (an article, a conjunction, a
  possessive determiner), or in an ellipsis, a comma or a dash (Whisper writes "I think that..."
  for a speaker who stops mid-phrase);
- ``COMPLETE``: it ends in a full stop, a question mark or an exclamation mark after a word
  that can end one;
- ``UNKNOWN``: anything else, and always a transcript that ends in a digit or a single letter:
  numbers and codes are read in groups ("My number is 555." then "0192"), and Whisper puts a
  full stop after the first group as readily as after the last.

On the evaluation set (``python -m evaluation.turn_eval``), 21 of 69 asked mid-sentence pauses
read as COMPLETE ("Well, I really need this." before "a bigger table"), so the words alone never
end a turn: the policy (:mod:`duplex.turns.semantic_policy`) weighs the text judge's probability
for COMPLETE words and holds the turn for INCOMPLETE ones. Stateless.
"""

from __future__ import annotations

import enum
import re


class Words(enum.StrEnum):
    COMPLETE = "complete"
    INCOMPLETE = "incomplete"
    UNKNOWN = "unknown"


# Words after which an English sentence goes on, whatever else is said. Only those that never end
# one: prepositions ("Where are you from?"), auxiliaries ("How many legs does a spider have?"),
# pronouns ("Who is she?") and relatives can, and the text judge (``finished_text``) reads those
# in context.
_CONTINUING_BY_KIND = {
    "articles": "a an the",
    "conjunctions": "and or nor because although though unless whereas",
    "possessive determiners": "my your our their",
}
_CONTINUING = frozenset(w for words in _CONTINUING_BY_KIND.values() for w in words.split())
_WORD = re.compile(r"[a-z0-9']+")
_ENDS_UNFINISHED = ("...", "…", ",", "-", "—", ";", ":")


def read_transcript(transcript: str) -> Words:
    """What the last words of ``transcript`` say about the turn (see the module doc)."""
    text = transcript.strip()
    words = _WORD.findall(text.lower())
    if not words:
        return Words.UNKNOWN
    if text.endswith(_ENDS_UNFINISHED) or words[-1] in _CONTINUING:
        return Words.INCOMPLETE
    last = words[-1]
    if last[-1].isdigit() or len(last) == 1:
        return Words.UNKNOWN
    return Words.COMPLETE if text[-1] in ".?!" else Words.UNKNOWN
