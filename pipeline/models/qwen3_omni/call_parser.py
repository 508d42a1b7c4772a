"""The thinker's answer text split into words and a function call, as it streams.

Qwen writes a call as ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` (see
``tools.py``). ``CallParser`` reads the answer's text deltas in order and says, per delta, which
text is words (to show and to voice) and what the call gained: its name once the name is complete,
then the arguments' JSON text as it grows. The tags are matched on text, so they may be split
over any number of tokens (the tiny checkpoint spells them a byte a token; the real tokenizer has
one added token per tag, not a special one, so it decodes to the tag's text): text that may be the
start of ``<tool_call>`` is held back until it is known to be or not to be one, and so is
trailing whitespace (before a call it is the template's separator).

One call per answer: the session's response holds one function call item, so the parser stops at
the first call's ``</tool_call>`` (``closed``) and the thinker ends the answer there. A call that is
still open when the answer ends (EOS, the token cap) ends with what was written (``close``): its
name as far as it got (``""`` if none), its arguments as they are, possibly not valid JSON.

The arguments are the raw text of the call object's ``"arguments"`` value, whatever its type;
other keys are skipped. Pieces of a call carry the name from the first piece on, so arguments
written before the name (an unusual key order) wait for it.

Per-request state, owned by the thinker's ThinkerState: created with the request's state,
dropped with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

from pipeline.models.qwen3_omni.tools import CLOSE, OPEN


@dataclass
class Parsed:
    """What one text delta of the answer gave: words, and a piece of the call (``{"name",
    "arguments"}``: the arguments' new text) or None."""

    text: str = ""
    call: dict[str, str] | None = None

    def then(self, later: Parsed) -> Parsed:
        """This and a later result as one."""
        if self.call is None or later.call is None:
            call = self.call or later.call
        else:
            call = {"name": later.call["name"], "arguments": self.call["arguments"] + later.call["arguments"]}
        return Parsed(self.text + later.text, call)

    def as_data(self) -> dict[str, Any]:
        """The chunk field ``parsed`` that carries this to the ``decode`` stage."""
        return {"text": self.text, "function_call": self.call}


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag`` (they wait for the next delta)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _Where(Enum):
    OBJECT = auto()  # before the call object's "{"
    KEY = auto()  # before a key (or between members)
    IN_KEY = auto()
    COLON = auto()
    VALUE = auto()  # before a value
    IN_VALUE = auto()
    DONE = auto()  # the object closed, or it is not an object: the rest is ignored


class _CallObject:
    """An incremental reader of the call's JSON object: the ``name`` value once it is complete,
    the raw text of the ``arguments`` value so far."""

    def __init__(self) -> None:
        self.where = _Where.OBJECT
        self.key = ""
        self.name: str | None = None
        self.name_raw = ""
        self.arguments = ""
        self._value = ""  # the raw text of the value being read
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> None:
        for char in text:
            self._char(char)

    def partial_name(self) -> str:
        """The name as far as it was written (the answer ended inside it)."""
        if self.name is not None:
            return self.name
        raw = self.name_raw.rstrip("\\")
        try:
            return str(json.loads(raw + '"')) if raw.startswith('"') else raw
        except ValueError:
            return raw.strip('"')

    def _char(self, c: str) -> None:
        where = self.where
        if where is _Where.IN_KEY:
            self._string_char(c)
            self._value += c
            if not self._in_string:
                self.key, self.where = self._decode(self._value), _Where.COLON
            return
        if where is _Where.IN_VALUE:
            self._value_char(c)
            return
        if c.isspace() or where is _Where.DONE:
            return
        if where is _Where.OBJECT:
            self.where = _Where.KEY if c == "{" else _Where.DONE
        elif where is _Where.KEY:
            if c == '"':
                self.where, self._value, self._in_string, self._escaped = _Where.IN_KEY, c, True, False
            elif c != ",":
                self.where = _Where.DONE  # "}" closes the object; anything else is not JSON
        elif where is _Where.COLON:
            self.where = _Where.VALUE if c == ":" else _Where.DONE
        elif where is _Where.VALUE:
            self.where, self._value, self._depth = _Where.IN_VALUE, "", 0
            self._in_string, self._escaped = False, False
            self._value_char(c)

    def _string_char(self, c: str) -> None:
        """Track a JSON string: ``_in_string`` turns False at its closing quote."""
        if self._escaped:
            self._escaped = False
        elif c == "\\":
            self._escaped = True
        elif c == '"':
            self._in_string = False

    def _value_char(self, c: str) -> None:
        first = not self._value
        if self._in_string:
            self._string_char(c)
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]" and self._depth > 0:
            self._depth -= 1
        elif self._depth == 0 and not first and (c in ",}" or c.isspace()):
            # The end of a scalar value: this character belongs to the object, not the value.
            self._end_value()
            self.where = _Where.DONE if c == "}" else _Where.KEY
            return
        self._take(c)
        if not self._in_string and self._depth == 0 and c in '"}]':  # a string or container closed
            self._end_value()
            self.where = _Where.KEY

    def _take(self, c: str) -> None:
        self._value += c
        if self.key == "arguments":
            self.arguments += c
        elif self.key == "name":
            self.name_raw += c

    def _end_value(self) -> None:
        if self.key == "name":
            self.name = self._decode(self._value)

    @staticmethod
    def _decode(raw: str) -> str:
        try:
            value = json.loads(raw)
        except ValueError:
            return raw.strip('"')
        return value if isinstance(value, str) else raw


class CallParser:
    """Splits one answer's text deltas into words and one function call (see the module doc).

    ``opening``: text the prompt already holds at the start of the answer (a forced call's
    opening, ``tools.call_opening``); it is read, never emitted as words.
    """

    def __init__(self, opening: str = "") -> None:
        self._held = ""
        self._call: _CallObject | None = None
        self._named = False
        self._sent = 0
        self.closed = False
        if opening:
            self._read(opening)

    @property
    def in_call(self) -> bool:
        """A call has begun (the answer's words are over)."""
        return self._call is not None

    @property
    def holding(self) -> bool:
        """Text is held back: it may yet turn out to open a call."""
        return self._call is None and bool(self._held)

    def feed(self, delta: str) -> Parsed:
        text = self._read(delta)
        return Parsed(text, self._piece(final=False) if self._call is not None else None)

    def close(self) -> Parsed:
        """The answer ended: words held back are words after all; an open call ends as it is."""
        if self._call is None:
            text, self._held = self._held, ""
            return Parsed(text)
        if not self.closed:
            self._call.feed(self._held)
            self._held = ""
            self.closed = True
        return Parsed("", self._piece(final=True))

    def _read(self, delta: str) -> str:
        """Take ``delta``; the words it completes (text before a call)."""
        if self.closed:
            return ""
        words = ""
        buf = self._held + delta
        if self._call is None:
            at = buf.find(OPEN)
            if at < 0:
                # Trailing whitespace waits too: before a call it is the template's separator,
                # not words.
                words = buf[: len(buf) - _held(buf, OPEN)].rstrip()
                self._held = buf[len(words):]
                return words
            words, buf = buf[:at].rstrip(), buf[at + len(OPEN):]
            self._call = _CallObject()
        at = buf.find(CLOSE)
        if at >= 0:
            body, self._held, self.closed = buf[:at], "", True
        else:
            keep = _held(buf, CLOSE)
            body, self._held = buf[: len(buf) - keep], buf[len(buf) - keep:]
        self._call.feed(body)
        return words

    def _piece(self, final: bool) -> dict[str, Any] | None:
        call = self._call
        assert call is not None
        name = call.name if call.name is not None else (call.partial_name() if final else None)
        if name is None:
            return None
        delta = call.arguments[self._sent:]
        if not delta and not (final and not self._named):
            return None  # no empty argument deltas; a call with none still ends with its name
        self._named, self._sent = True, len(call.arguments)
        return {"name": name, "arguments": delta}
