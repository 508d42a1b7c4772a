"""Cutting a streamed answer into clauses, so that synthesis can start on the first one.

A ``ClauseSplitter`` belongs to one request's speech state (``tts.SpeechState``) and lives as long
as it. Text arrives as LM deltas; a clause ends at ``, . ! ? ; :`` once the next character is
whitespace (so "3.5" or "1,000" are not cut), or at a newline. Clauses shorter than ``min_chars``
are joined with the next one (piper voices two-word fragments choppily), and a clause that grows
past ``max_chars`` without punctuation is cut at its last space, which also bounds the time one
synthesis step takes (and therefore how long an abort can wait for it).

The first clause may be cut sooner: with ``first_words``, it ends after that many words where no
punctuation has ended it yet ("The capital of Japan" | " is Tokyo."). Its speech is what the
listener waits for, and its synthesis waits for its last word: a short first phrase starts the
answer a few tokens and a shorter synthesis sooner, and the clauses after it are voiced while it
plays. Later clauses keep to punctuation (a seam in every phrase would sound choppy).

Every character of the input ends up in exactly one clause, whitespace included: concatenating the
clauses gives back the text, which is what makes ``spoken_text`` exact.
"""

from __future__ import annotations

PUNCTUATION = frozenset(",.!?;:")


class ClauseSplitter:
    def __init__(self, min_chars: int = 10, max_chars: int = 160, first_words: int = 0) -> None:
        self._min_chars = min_chars
        self._max_chars = max_chars
        self._first_words = first_words  # 0: the first clause ends as the others do
        self._first = True
        self._pending = ""

    def push(self, text: str) -> list[str]:
        """Append a delta; return the clauses it completed (possibly none)."""
        self._pending += text
        clauses: list[str] = []
        while (cut := self._next_cut()) is not None:
            clauses.append(self._pending[:cut])
            self._pending = self._pending[cut:]
            self._first = False
        return clauses

    def flush(self) -> list[str]:
        """The end of the answer: whatever is pending is the last clause."""
        rest, self._pending = self._pending, ""
        return [rest] if rest else []

    def _next_cut(self) -> int | None:
        text = self._pending
        for i, char in enumerate(text):
            ends = char == "\n" or (
                char in PUNCTUATION and i + 1 < len(text) and text[i + 1].isspace()
            )
            if ends and len(text[: i + 1].strip()) >= self._min_chars:
                return i + 1
        if len(text) > self._max_chars:
            space = text.rfind(" ", 0, self._max_chars)
            return space if space > 0 else self._max_chars
        if self._first and self._first_words:
            return self._after_words(text, self._first_words)
        return None

    @staticmethod
    def _after_words(text: str, count: int) -> int | None:
        """Where the ``count``-th word of ``text`` ends, once a space shows it is whole."""
        words, in_word = 0, False
        for i, char in enumerate(text):
            if char.isspace():
                if in_word and (words := words + 1) == count:
                    return i
                in_word = False
            else:
                in_word = True
        return None
