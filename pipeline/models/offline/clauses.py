"""Cutting a streamed answer into clauses, so that synthesis can start on the first one.

A ``ClauseSplitter`` belongs to one request's speech state (``tts.SpeechState``) and lives as long
as it. Text arrives as LM deltas; a clause ends at ``, . ! ? ; :`` once the next character is
whitespace (so "3.5" or "1,000" are not cut), or at a newline. Clauses shorter than ``min_chars``
are joined with the next one (piper voices two-word fragments choppily), and a clause that grows
past ``max_chars`` without punctuation is cut at its last space, which also bounds the time one
synthesis step takes (and therefore how long an abort can wait for it).

Every character of the input ends up in exactly one clause, whitespace included: concatenating the
clauses gives back the text, which is what makes ``spoken_text`` exact.
"""

from __future__ import annotations

PUNCTUATION = frozenset(",.!?;:")


class ClauseSplitter:
    def __init__(self, min_chars: int = 10, max_chars: int = 160) -> None:
        self._min_chars = min_chars
        self._max_chars = max_chars
        self._pending = ""

    def push(self, text: str) -> list[str]:
        """Append a delta; return the clauses it completed (possibly none)."""
        self._pending += text
        clauses: list[str] = []
        while (cut := self._next_cut()) is not None:
            clauses.append(self._pending[:cut])
            self._pending = self._pending[cut:]
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
        return None
