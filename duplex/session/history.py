"""A conversation's history: its items, what the user actually heard, and the model's messages.

Owned by one session, for its whole life. User turns keep their 16 kHz audio (the model hears them
again on later turns) within an audio budget: the oldest audio beyond it leaves the model's context.
Assistant turns keep their text; a truncated turn keeps only the text of the audio that was played
(OpenAI ``conversation.item.truncate`` semantics, DESIGN.md invariant 7). Where the model says how
many answer tokens each audio chunk voiced and each text delta covers, that text is the text of
exactly the answer tokens a barge-in keeps in the model's state (``voiced_tokens``), so the next
turn's history says what the kept state holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_ITEMS = 64


@dataclass
class Item:
    id: str
    role: str  # "user" | "assistant" | "system"
    text: str | None = None
    audio: np.ndarray | None = None  # float32 mono at ``sample_rate``
    sample_rate: int | None = None
    images: list[np.ndarray] = field(default_factory=list)  # uint8 RGB [height, width, 3] each
    # Where the images are a camera's frames during a spoken turn: when each was seen (seconds
    # from the first), which a model that reads video reads as one video; None: separate images.
    image_times: list[float] | None = None
    # Assistant items: each transcript delta with the audio position (ms) queued when it arrived
    # (its audio starts there or later: text runs ahead of audio), and the length of the item's
    # audio once the whole answer is generated.
    deltas: list[tuple[str, int]] = field(default_factory=list)
    # Where the audio of each piece of text starts and ends (ms), when the model says exactly which
    # text each audio chunk voices (a synthesis stage does); truncation is then exact.
    spans: list[tuple[int, int, str]] = field(default_factory=list)
    # Where the model counts answer tokens (its audio chunks' ``answer_tokens``, its text chunks'
    # ``text_tokens``): (end of the audio so far in ms, answer tokens voiced by then) per audio
    # chunk, and the answer tokens the text covers through each delta (one per delta, cumulative).
    # Truncation then keeps the text of the tokens the model's kept state keeps.
    voiced: list[tuple[int, int]] = field(default_factory=list)
    delta_tokens: list[int] = field(default_factory=list)
    spoken_ms: int | None = None
    truncated_at_ms: int | None = None
    speaks: bool = False  # an answer of the model's with audio (its content is output_audio)
    transcribed: bool = False  # ``text`` is a recogniser's transcript of ``audio``
    # Function calling: a call of the model's (role assistant) or its result (role user), with
    # ``call``'s name and arguments (JSON text), or the output the client sent.
    call: FunctionCall | None = None

    @property
    def transcript(self) -> str:
        return "".join(d for d, _ in self.deltas) if self.deltas else (self.text or "")


@dataclass
class FunctionCall:
    """A function call item (``output`` None) or its result (``function_call_output``). The model
    gets both as messages: the call as the assistant's, the result as the user's, each with its
    fields (``fields``) and a plain rendering (``as_text``) for models that read text only."""

    call_id: str
    name: str = ""
    arguments: str = ""
    output: str | None = None

    @property
    def as_text(self) -> str:
        if self.output is None:
            return f"(calling {self.name} with {self.arguments})"
        return f"(result of {self.name or self.call_id}: {self.output})"

    @property
    def fields(self) -> dict[str, Any]:
        """The message fields of this call or result (see ``History.messages``)."""
        if self.output is None:
            call = {"call_id": self.call_id, "name": self.name, "arguments": self.arguments}
            return {"tool_calls": [call], "words": None}
        return {"tool_result": {"call_id": self.call_id, "name": self.name, "output": self.output}}


class History:
    def __init__(self, max_audio_s: float) -> None:
        self.items: list[Item] = []
        self._max_audio_s = max_audio_s

    def add(self, item: Item) -> Item:
        self.items.append(item)
        del self.items[:-MAX_ITEMS]
        return item

    def get(self, item_id: str) -> Item | None:
        return next((i for i in self.items if i.id == item_id), None)

    def remove(self, item_id: str) -> bool:
        """Drop the item ``item_id``; False when there is none."""
        item = self.get(item_id)
        if item is not None:
            self.items.remove(item)
        return item is not None

    def last_user_before(self, item_id: str) -> Item | None:
        """The newest user item older than ``item_id``."""
        older = False
        for item in reversed(self.items):
            if older and item.role == "user":
                return item
            older = older or item.id == item_id
        return None

    @property
    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def truncate(self, item: Item, audio_end_ms: int) -> int | None:
        """Keep only the text of the audio the user heard, the first ``audio_end_ms`` of it; returns
        the answer tokens whose text the item keeps where that is token-exact (else None).

        When the model said which text each audio chunk voices, the heard text is exact: every
        span whose audio had ended, and of the span being spoken its heard share, through the word
        being spoken. When it counted answer tokens instead, the text is that of the answer tokens
        voiced by the chunk being heard (``voiced_tokens``: what a barge-in keeps of the model's
        state), token-exact. Otherwise, when the whole answer's audio is known, its text spreads
        over it: the heard share of the audio keeps that share of the text, to the end of the word
        being spoken. Before that, only the text that arrived before the audio reached
        ``audio_end_ms`` can have been heard (text runs ahead of audio, so this keeps more than was
        heard, never less).
        """
        tokens = voiced_tokens(item, audio_end_ms)
        exact = not item.spans and tokens is not None and len(item.delta_tokens) == len(item.deltas)
        if item.spans:
            kept = _heard_spans(item.spans, audio_end_ms)
            item.deltas = [(kept, 0)] if kept else []
        elif exact:
            # Text runs ahead of audio, so the text of every voiced token is in by now. (A character
            # whose bytes the last kept token only begins comes with the token that completes it,
            # and is left out.)
            heard = [(d, n) for d, n in zip(item.deltas, item.delta_tokens, strict=True) if n <= tokens]
            item.deltas, item.delta_tokens = [d for d, _ in heard], [n for _, n in heard]
            if item.spoken_ms:
                item.spoken_ms = min(item.spoken_ms, audio_end_ms)
        elif item.spoken_ms:
            text = item.transcript
            kept = _through_word(text, round(len(text) * min(1.0, audio_end_ms / item.spoken_ms)))
            item.deltas = [(kept, 0)] if kept else []
            item.spoken_ms = min(item.spoken_ms, audio_end_ms)
        else:
            item.deltas = [(d, at) for d, at in item.deltas if at < audio_end_ms]
        item.text = "".join(d for d, _ in item.deltas)
        item.truncated_at_ms = audio_end_ms
        return tokens if exact else None

    def messages(self, instructions: str | None, pending: Item | None = None) -> list[dict[str, Any]]:
        """The model's input (OmniRequest.inputs["messages"]), newest audio first in the budget;
        ``pending`` is answered as if it were the newest item (a turn not yet committed). A turn
        heard as audio whose transcript is known carries it as ``transcript``, not ``text``. A
        message with images carries them as ``images`` (uint8 RGB arrays), and a camera's frames
        their ``image_times`` too; they stay in context.

        Function calls: an assistant message that made calls has ``tool_calls`` (``[{"call_id",
        "name", "arguments"}]``) and its own words as ``words`` (None when it only called); a call
        item joins the assistant message just before it (see ``_fold_calls``). A result is a user
        message with ``tool_result`` (``{"call_id", "name", "output"}``). ``text`` holds the plain
        rendering of both, for models that read text only."""
        budget = self._max_audio_s
        kept: list[dict[str, Any]] = []
        items = self.items if pending is None else [*self.items, pending]
        for item in reversed(items):
            text = item.call.as_text if item.call is not None else item.transcript or None
            message: dict[str, Any] = {"role": item.role, "text": text, "audio": None, "sample_rate": None}
            if item.call is not None:
                message.update(item.call.fields)
            if item.audio is not None and item.sample_rate:
                seconds = len(item.audio) / item.sample_rate
                if seconds > budget:
                    if message["text"] is None:
                        continue
                else:
                    budget -= seconds
                    message["audio"], message["sample_rate"] = item.audio, item.sample_rate
                    if item.transcribed:
                        # The model hears the audio; its transcript rides along for models that
                        # read text only (and is the turn's text once the audio leaves the budget).
                        message["text"], message["transcript"] = None, text
            if item.images:
                message["images"] = item.images
                if item.image_times is not None:
                    message["image_times"] = item.image_times
            if message["text"] is None and message["audio"] is None and not item.images:
                continue
            kept.append(message)
        kept = _fold_calls(kept[::-1])
        if instructions:
            kept.insert(0, {"role": "system", "text": instructions, "audio": None, "sample_rate": None})
        return kept

    def clear(self) -> None:
        self.items.clear()


def _fold_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each call joined to the assistant message before it: a model writes its
    words and calls as one answer, and kept model state counts one message per answer (a call
    after an answer of an earlier response joins it too; the model then just prefills anew)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        previous = out[-1] if out else None
        if message.get("tool_calls") and previous is not None and previous["role"] == "assistant" \
                and previous["audio"] is None:
            if "tool_calls" not in previous:
                previous["words"], previous["tool_calls"] = previous["text"], []
            previous["tool_calls"] = [*previous["tool_calls"], *message["tool_calls"]]
            previous["text"] = f"{previous['text']} {message['text']}"
            continue
        out.append(message)
    return out


def voiced_tokens(item: Item, audio_end_ms: int) -> int | None:
    """The answer tokens voiced by the audio chunk being heard at ``audio_end_ms`` (counting from
    the answer's start), where the model says how many each chunk voiced; None where it does not.
    A barge-in keeps that many in the model's state, and truncation the text of that many."""
    if not item.voiced:
        return None
    return next((tokens for end_ms, tokens in item.voiced if end_ms >= audio_end_ms), item.voiced[-1][1])


def _heard_spans(spans: list[tuple[int, int, str]], audio_end_ms: int) -> str:
    """The text of ``spans`` (start ms, end ms, text) heard in the first ``audio_end_ms``."""
    heard: list[str] = []
    for start, end, text in spans:
        if start >= audio_end_ms:
            break
        if end <= audio_end_ms:
            heard.append(text)
            continue
        share = (audio_end_ms - start) / max(1, end - start)
        heard.append(_through_word(text, round(len(text) * share)))
        break
    return "".join(heard)


def _through_word(text: str, end: int) -> str:
    """``text[:end]``, carried on to the end of the word it cuts (that word was being heard)."""
    if end <= 0:
        return ""
    if end >= len(text) or text[end - 1].isspace():
        return text[:end]
    space = next((i for i in range(end, len(text)) if text[i].isspace()), len(text))
    return text[:space]
