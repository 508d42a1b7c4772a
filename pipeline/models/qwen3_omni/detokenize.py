"""Decode stage (text terminal): thinker token ids -> text deltas, with no per-request state.

Byte-level BPE tokens do not map one-to-one to characters: a character may span several tokens,
and until its last byte arrives the decoded text ends in U+FFFD. Each thinker chunk therefore
carries the DETOK_CONTEXT tokens before the new one, and the delta of a token is the stable text of
``context + [token]`` minus the stable text of ``context``, where "stable" drops one trailing
U+FFFD (an incomplete UTF-8 sequence is always one maximal invalid subpart, hence one U+FFFD). The
context covers the longest UTF-8 sequence (4 bytes) with room to spare, so the deltas of a stream
concatenate to ``decode(all tokens)``; the final item flushes what was held back. Special tokens
(EOS, ...) decode to nothing.

Chunk output: ``{"text": delta, "token_ids": [id]}``; final output adds ``usage`` and
``finish_reason`` from the thinker.
"""

from __future__ import annotations

from typing import Any

from pipeline.models import StageContext
from pipeline.models.qwen3_omni import loading
from pipeline.scheduling.base import BatchItem

DETOK_CONTEXT = 8
"""Tokens of left context per delta (>= 4, the longest UTF-8 sequence, even at one byte a token)."""

REPLACEMENT = "\ufffd"


def _stable(text: str) -> str:
    return text[:-1] if text.endswith(REPLACEMENT) else text


class Detokenizer:
    """BatchRunner for the ``decode`` stage."""

    def __init__(self, ctx: StageContext) -> None:
        source = loading.resolve(ctx.model_args)
        self.tokenizer = loading.load_tokenizer(source.path)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def delta(self, context: list[int], token: int) -> str:
        before = _stable(self._text(context))
        return _stable(self._text(context + [token]))[len(before):]

    def flush(self, context: list[int]) -> str:
        text = self._text(context)
        return text[len(_stable(text)):]

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        out = []
        for item in batch:
            data = item.payload.data
            if item.final:
                final = {"text": self.flush(list(data.get("context_ids", [])))}
                final.update({k: data[k] for k in ("usage", "finish_reason") if k in data})
                out.append(final)
            else:
                token = int(data["token_id"])
                out.append({"text": self.delta(list(data["context_ids"]), token), "token_ids": [token]})
        return out
