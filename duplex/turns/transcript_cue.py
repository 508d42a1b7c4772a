"""The words of a pause: whether the transcript of the user's turn so far reads as finished.

semantic_vad hears intonation (:mod:`duplex.turns.end_of_turn`); where the model pipeline
recognises speech (the ``offline`` preset's ``asr`` stage), a speculative response started at the
pause brings back the transcript of the turn so far (:mod:`duplex.session.speculation`), and its
last words say what audio cannot: "I want to fly from Boston to" has not finished however its
pitch falls, and "...to Chicago next Friday." has.

:func:`read_transcript` sorts a transcript into three kinds, by rules that hold for English:

- ``INCOMPLETE``: it ends in a word that cannot end a sentence (an article, a preposition, a
  conjunction, a possessive, an auxiliary, a subject pronoun), or in an ellipsis, a comma or a
  dash (Whisper writes "I think that..." for a speaker who stops mid-phrase);
- ``COMPLETE``: it ends in a full stop, a question mark or an exclamation mark after a word
  that can end one;
- ``UNKNOWN``: anything else, and always a transcript that ends in a digit or a single letter:
  numbers and codes are read in groups ("My number is 555." then "0192"), and Whisper puts a
  full stop after the first group as readily as after the last.

On the espeak-ng evaluation set (``python -m evaluation.turn_eval``), 10 of 46 mid-sentence pauses
read as COMPLETE ("Well, I really need this." before "a bigger table"), so the words alone never
end a turn: the policy (:mod:`duplex.turns.semantic_policy`) lowers the bar for COMPLETE words and
holds it up for INCOMPLETE ones. Stateless.
"""

from __future__ import annotations

import enum
import re


class Words(enum.StrEnum):
    COMPLETE = "complete"
    INCOMPLETE = "incomplete"
    UNKNOWN = "unknown"


# Words after which an English sentence goes on. Object pronouns ("you", "me", "it") are not
# here: "Thank you." ends a turn.
_CONTINUING_BY_KIND = {
    "articles": "a an the",
    "prepositions": "to of for with from at in on near into onto by about than as like",
    "conjunctions": "and or but nor because although though if unless while whereas",
    "possessives and relatives": "my your our their his her its whose which who",
    "auxiliaries": "is are was were am be been being do does did have has had will would can "
                   "could should shall may might must",
    "subject pronouns": "i we they he she",
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
