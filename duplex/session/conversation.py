"""A session's conversation as its client sees it: the history, and the event for each change.

Every change to the items a client can see goes through :class:`Conversation`, so that the
history (what the model is sent) and the events (what the client is told) never disagree: an
item committed from the user's audio, created by the client, added by a response, withdrawn,
deleted or truncated to what was heard. It belongs to one Session and lives as long as it; the
:class:`~duplex.session.history.History` it edits is the session's.

It also keeps, for each user turn transcribed while it was spoken
(:mod:`duplex.session.live_transcript`), the text already told in deltas, so that the turn's final
transcript tells only the rest: from the turn's first firmed words until its transcript completes
or fails, or the item is deleted (a turn dropped before its commit is forgotten at the next turn).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from duplex.protocol.events import RealtimeError, event, item_added
from duplex.protocol.items import wire_item
from duplex.session.history import History, Item


class Conversation:
    def __init__(self, history: History, send: Callable[[dict[str, Any]], None]) -> None:
        self.history = history
        self._send = send
        self._told: dict[str, str] = {}  # a user item's id -> its transcript's text told so far

    def close(self) -> None:
        """The session closed: tell nobody any more (``send`` is the session's, which owns this)."""
        self._send = _nobody

    def add(self, item: Item) -> str | None:
        """Append ``item`` without announcing it (a response announces its own); returns the id of
        the item before it."""
        previous = self.history.last_id
        self.history.add(item)
        return previous

    def withdraw(self, item: Item) -> None:
        """Take a response's unannounced item out again (a function call took its place)."""
        self.history.remove(item.id)

    def commit_user_audio(self, item: Item) -> None:
        """A user turn committed from the input audio buffer: added and announced."""
        previous = self.add(item)
        self._send(event("input_audio_buffer.committed", previous_item_id=previous, item_id=item.id))
        self._announce(item, previous)

    def create(self, item: Item) -> None:
        """``conversation.item.create``: a client's item (or the server's, e.g. a keypress), added
        and announced."""
        if self.history.get(item.id) is not None:
            raise RealtimeError(f"item id {item.id!r} already exists", param="item.id")
        self._announce(item, self.add(item))

    def delete(self, item_id: str) -> None:
        if not self.history.remove(item_id):
            raise RealtimeError(f"no item {item_id!r}", code="item_not_found", param="item_id")
        self._told.pop(item_id, None)
        self._send(event("conversation.item.deleted", item_id=item_id))

    def truncate(self, item: Item, audio_end_ms: int) -> int | None:
        """Cut an assistant item to the audio the user heard (its text too: see History); returns
        the answer tokens whose text it keeps, where that is token-exact."""
        tokens = self.history.truncate(item, audio_end_ms)
        self._send(event("conversation.item.truncated", item_id=item.id, content_index=0,
                         audio_end_ms=audio_end_ms))
        return tokens

    def transcribing(self, item_id: str, words: list[str]) -> None:
        """Words of the user's turn ``item_id`` (the item it becomes) firmed up while it is spoken:
        told as the next delta of its transcription."""
        told = self._told.get(item_id)
        if told is None:
            # A turn dropped before its commit (a cleared buffer) never completes: forget it.
            self._told = {i: t for i, t in self._told.items() if self.history.get(i) is not None}
        delta = (" " if told else "") + " ".join(words)
        self._told[item_id] = (told or "") + delta
        self._send(event("conversation.item.input_audio_transcription.delta", item_id=item_id,
                         content_index=0, delta=delta))

    def transcribed(self, user: Item, transcript: str) -> None:
        """The recogniser's text of a spoken user turn: kept as its text, and told (what the deltas
        of :meth:`transcribing` did not tell yet, then the whole)."""
        user.text, user.transcribed = transcript, True
        seconds = len(user.audio) / user.sample_rate if user.audio is not None and user.sample_rate else 0.0
        told = self._told.pop(user.id, "")
        rest = _rest(transcript, told)
        # Without deltas while it was spoken, the recogniser wrote the turn at once: its one delta
        # is the whole text (as whisper-1's).
        if rest or not told:
            self._send(event("conversation.item.input_audio_transcription.delta", item_id=user.id,
                             content_index=0, delta=rest))
        self._send(event("conversation.item.input_audio_transcription.completed", item_id=user.id,
                         content_index=0, transcript=transcript,
                         usage={"type": "duration", "seconds": round(seconds, 3)}))

    def not_transcribed(self, user: Item, model_name: str) -> None:
        """A spoken turn answered without a transcript though the client asked for one."""
        self._told.pop(user.id, None)
        self._send(event("conversation.item.input_audio_transcription.failed", item_id=user.id,
                         content_index=0, error={
                             "type": "transcription_error", "code": "not_transcribed",
                             "message": f"the {model_name} pipeline did not transcribe this turn"}))

    def _announce(self, item: Item, previous: str | None) -> None:
        wire = wire_item(item)
        for message in [*item_added(wire, previous), event("conversation.item.done", item=wire)]:
            self._send(message)


def _rest(transcript: str, told: str) -> str:
    """What of ``transcript`` is left to tell after ``told``: the text after it where the final
    transcript begins with it (the deltas and the rest then make the transcript exactly), else the
    text after as many words (the recogniser changed its mind on words told: they cannot be
    taken back)."""
    if transcript.startswith(told):
        return transcript[len(told):]
    words = list(re.finditer(r"\S+", transcript))
    count = len(told.split())
    return transcript[words[count - 1].end():] if count <= len(words) else ""


def _nobody(message: dict[str, Any]) -> None:
    """Where a closed session's conversation sends its events."""
