"""A session's conversation as its client sees it: the history, and the event for each change.

Every change to the items a client can see goes through :class:`Conversation`, so that the
history (what the model is sent) and the events (what the client is told) never disagree: an
item committed from the user's audio, created by the client, added by a response, withdrawn,
deleted or truncated to what was heard. It belongs to one Session and lives as long as it; the
:class:`~duplex.session.history.History` it edits is the session's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from duplex.protocol.events import RealtimeError, event, item_added
from duplex.protocol.items import wire_item
from duplex.session.history import History, Item


class Conversation:
    def __init__(self, history: History, send: Callable[[dict[str, Any]], None]) -> None:
        self.history = history
        self._send = send

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
        self._send(event("conversation.item.deleted", item_id=item_id))

    def truncate(self, item: Item, audio_end_ms: int) -> int | None:
        """Cut an assistant item to the audio the user heard (its text too: see History); returns
        the answer tokens whose text it keeps, where that is token-exact."""
        tokens = self.history.truncate(item, audio_end_ms)
        self._send(event("conversation.item.truncated", item_id=item.id, content_index=0,
                         audio_end_ms=audio_end_ms))
        return tokens

    def transcribed(self, user: Item, transcript: str) -> None:
        """The recogniser's text of a spoken user turn: kept as its text, and told."""
        user.text, user.transcribed = transcript, True
        seconds = len(user.audio) / user.sample_rate if user.audio is not None and user.sample_rate else 0.0
        # The recogniser writes a turn at once, so its one delta is the whole text (as whisper-1's).
        self._send(event("conversation.item.input_audio_transcription.delta", item_id=user.id,
                         content_index=0, delta=transcript))
        self._send(event("conversation.item.input_audio_transcription.completed", item_id=user.id,
                         content_index=0, transcript=transcript,
                         usage={"type": "duration", "seconds": round(seconds, 3)}))

    def not_transcribed(self, user: Item, model_name: str) -> None:
        """A spoken turn answered without a transcript though the client asked for one."""
        self._send(event("conversation.item.input_audio_transcription.failed", item_id=user.id,
                         content_index=0, error={
                             "type": "transcription_error", "code": "not_transcribed",
                             "message": f"the {model_name} pipeline did not transcribe this turn"}))

    def _announce(self, item: Item, previous: str | None) -> None:
        wire = wire_item(item)
        for message in [*item_added(wire, previous), event("conversation.item.done", item=wire)]:
            self._send(message)


def _nobody(message: dict[str, Any]) -> None:
    """Where a closed session's conversation sends its events."""
