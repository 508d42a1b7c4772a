"""The words of speech over the agent: whether they are a backchannel, or an interruption.

A listener says "mhm", "yeah", "right", "okay", "I see" while the other one talks, to show that
they follow, not to take the turn. Where the model pipeline recognises speech, a short fragment
of speech over the agent is transcribed (:mod:`duplex.session.barge_in`) and
:func:`is_backchannel` reads it: the agent goes on after a backchannel and stops for anything else.

The rule, for English: at most :data:`MAX_WORDS` words, every one of them a listener's token
(:data:`_LISTENER_WORDS`, or a hum: Whisper tiny.en writes piper's "mm-hmm" as "NMM"), and none that takes the turn: "no", "wait", "stop", "but", a question
mark. "Yeah, yeah." and "Uh-huh, okay." are backchannels; "Yeah, but" and "Okay, stop." are not,
and neither is an empty transcript (a cough, a click: the recogniser heard no word), which the
session treats as any other unrecognised fragment. Stateless.
"""

from __future__ import annotations

import re

MAX_WORDS = 4

# What Whisper writes for a listener's tokens (its spellings of "mm-hmm" vary: "Mm-hmm", "Mhm").
_LISTENER_WORDS = frozenset({
    "mhm", "mm", "mmhmm", "mmm", "hm", "hmm", "uhhuh", "um", "yeah", "yea", "yes", "yep", "yup",
    "ok", "okay", "right", "sure", "alright", "gotit", "isee", "oh", "ah", "wow", "cool", "nice",
    "true", "exactly", "indeed", "totally", "gotcha",
})
# Two-word tokens, joined before the words are read: "I" or "see" alone may begin a sentence.
_PHRASES = {"got it": "gotit", "i see": "isee", "uh huh": "uhhuh", "mm hmm": "mmhmm"}
_WORD = re.compile(r"[a-z']+")
# A hum, however Whisper spells it ("Mm-hmm.", "NMM", "Mm-mm"): only m, n and h, with an m.
_HUM = re.compile(r"(?=.*m)[mnh]{2,}")


def is_backchannel(transcript: str) -> bool:
    """Whether ``transcript`` (of a short fragment of speech over the agent) is a backchannel."""
    text = transcript.strip().lower()
    # Whisper joins "mm-hmm" and "uh-huh" with hyphens; as one word they are what they say.
    joined = " ".join(_WORD.findall(text.replace("-", "")))
    for phrase, token in _PHRASES.items():
        joined = re.sub(rf"\b{phrase}\b", token, joined)
    words = joined.split()
    if not words or len(words) > MAX_WORDS or "?" in text:
        return False
    return all(word in _LISTENER_WORDS or _HUM.fullmatch(word) for word in words)
