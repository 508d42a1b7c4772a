"""The thinker's state kept for a conversation between its requests (the ConversationRunner side).

A ``KeptThinker`` holds every token of the conversation so far (prompts and answers, as the chat
template renders them: ``<|im_start|>role\\n…<|im_end|>\\n`` per message), the KV cache of all of
them but the last answer token (which was sampled, never fed back), and the talker's prompt rows
of every user turn so far (the talker's prefill takes the rows of all user turns of the history,
as ``generate`` does). It also remembers where its last request began (``base``) and where that
request's answer begins (``answer_start``), so the request can be undone or its answer cut to what
the user heard. A state ``open`` ends inside a user turn still being spoken (pieces prefilled while
the user spoke: no answer, every token cached); its ``base`` is where that turn began, however many
pieces it took, so that undoing its last request undoes the whole turn (the VAD dropped it). The
answer to an open turn remembers it (``base_open``, ``turn_base``): undone, it is open again.
After an image a row's rope position is not its index (``rope.py``): the state keeps the difference
for its next row (``delta``) and where it undoes to (``base_delta``, ``turn_delta``); an answer cut
short keeps ``delta``, since no image lies inside an answer.

Ownership: the thinker runner creates it (``Thinker.keep``) and the ``ar`` scheduler's
KeptConversations owns it between requests; the conversation's next request takes it over
(``Thinker.resume``: its cache goes back into the runner's KVPool under the new request id), or
``drop`` frees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from pipeline.models.qwen3_omni.kv_pool import cache_bytes, crop_to


@dataclass
class KeptThinker:
    ids: torch.Tensor
    """Every token so far, 1-D long on the CPU."""
    cache: DynamicCache
    """KV of ``ids[:cache.get_seq_length()]``."""
    user_embeds: torch.Tensor
    """The talker's prompt rows of every user turn so far [U, hidden] (CPU)."""
    user_mm: torch.Tensor
    """Which of those rows are audio or images [U] (CPU)."""
    user_pos: torch.Tensor
    """The talker's rope positions of those rows [3, U] (CPU)."""
    base: int
    """len(ids) before the last request (0: it started the conversation's state)."""
    base_users: int
    answer_start: int
    """Where the last request's answer begins in ``ids``."""
    open: bool = False
    """It ends inside a user turn still being spoken (see the module doc)."""
    base_open: bool = False
    """Whether the state at ``base`` is open (this answers a turn prefilled in pieces)."""
    turn_base: int = 0
    """With ``base_open``: where that open turn began (its own ``base``)."""
    turn_users: int = 0
    delta: int = 0
    """The rope position of the next row minus its index."""
    base_delta: int = 0
    """``delta`` of the state at ``base``."""
    turn_delta: int = 0
    """With ``base_open``: ``delta`` of the state at ``turn_base``."""

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    def nbytes(self) -> int:
        tensors = [self.ids, self.user_embeds, self.user_mm, self.user_pos]
        return cache_bytes(self.cache) + sum(t.numel() * t.element_size() for t in tensors)


def cut(kept: KeptThinker, answer_tokens: int | None) -> KeptThinker | None:
    """``kept`` with its last request undone (``answer_tokens`` None) or its last answer cut to
    ``answer_tokens`` tokens; None when nothing is left. Reuses (crops) the same cache."""
    if answer_tokens is None:
        if kept.base == 0:
            return None
        length, users, delta = kept.base, kept.base_users, kept.base_delta
        # Back to an open turn, the state's own undo is the whole turn; else to where it is.
        base, base_users, base_delta = (
            (kept.turn_base, kept.turn_users, kept.turn_delta) if kept.base_open else (length, users, delta)
        )
        answer_start, is_open, base_open = length, kept.base_open, False
    else:
        length = min(kept.ids.numel(), kept.answer_start + max(0, int(answer_tokens)))
        users, delta = kept.user_mm.numel(), kept.delta
        base, base_users, base_delta, answer_start = kept.base, kept.base_users, kept.base_delta, kept.answer_start
        is_open, base_open = kept.open, kept.base_open
    crop_to(kept.cache, length)
    return KeptThinker(
        ids=kept.ids[:length].clone(),
        cache=kept.cache,
        user_embeds=kept.user_embeds[:users],
        user_mm=kept.user_mm[:users],
        user_pos=kept.user_pos[:, :users],
        base=base,
        base_users=base_users,
        answer_start=answer_start,
        open=is_open,
        base_open=base_open,
        turn_base=kept.turn_base,
        turn_users=kept.turn_users,
        delta=delta,
        base_delta=base_delta,
        turn_delta=kept.turn_delta,
    )
