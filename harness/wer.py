"""Word error rate after normalisation, for checking what was said against what was heard.

``normalize`` lower-cases, drops punctuation (apostrophes too: "it's" and "its" are the same
sound), and writes numbers as digits ("twenty one" -> "21", "1,000" -> "1000"), so that a
recogniser's choice between "5" and "five" is not an error. ``wer`` is the word-level edit distance
over the reference's length. Pure functions, no state.
"""

from __future__ import annotations

import re

_UNITS = {
    word: value
    for value, word in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen nineteen".split()
    )
}
_TENS = {
    word: 10 * value
    for value, word in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)
}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 1_000_000}


def _is_number_word(word: str) -> bool:
    return word in _UNITS or word in _TENS or word in _SCALES


def _number_value(words: list[str]) -> int:
    """The value of a run of number words ("two hundred and five" without the "and")."""
    total, current = 0, 0
    for word in words:
        if word in _UNITS:
            current += _UNITS[word]
        elif word in _TENS:
            current += _TENS[word]
        elif word == "hundred":
            current = max(current, 1) * 100
        else:
            total += max(current, 1) * _SCALES[word]
            current = 0
    return total + current


def _digits(words: list[str]) -> list[str]:
    out: list[str] = []
    run: list[str] = []
    for word in [*words, ""]:
        if _is_number_word(word) and not (run and _starts_new_number(run, word)):
            run.append(word)
            continue
        if run:
            out.append(str(_number_value(run)))
            run = []
        if _is_number_word(word):
            run.append(word)
        elif word:
            out.append(word)
    return out


def _starts_new_number(run: list[str], word: str) -> bool:
    """Whether ``word`` begins another number: "one two" is two numbers, "twenty one" is one."""
    last = run[-1]
    if word in _SCALES:
        return False
    if last in _TENS:
        return not (word in _UNITS and 0 < _UNITS[word] < 10)
    return last in _UNITS


def normalize(text: str) -> list[str]:
    """The words of ``text``: lower case, no punctuation, numbers as digits."""
    text = text.lower()
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)  # 1,000 -> 1000
    text = text.replace("'", "").replace("\u2019", "").replace("-", " ")
    text = re.sub(r"[^\w\s]", " ", text)
    return _digits(text.split())


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    previous = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        current = [i]
        for j, h in enumerate(hyp, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1]


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate of ``hypothesis`` against ``reference`` after ``normalize`` (0 = exact)."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    return edit_distance(ref, hyp) / len(ref)
