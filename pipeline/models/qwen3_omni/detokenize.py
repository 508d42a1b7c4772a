"""Decode stage (text terminal): thinker token ids -> text deltas, with no per-request state.

Byte-level BPE tokens do not map one-to-one to characters: a character may span several tokens,
and until its last byte arrives the decoded text ends in U+FFFD. Each thinker chunk therefore
carries the DETOK_CONTEXT tokens before the new one, and the delta of a token is the stable text of
``context + [token]`` minus the stable text of ``context``, where "stable" drops one trailing
U+FFFD (an incomplete UTF-8 sequence is always one maximal invalid subpart, hence one U+FFFD). The
context covers the longest UTF-8 sequence (4 bytes) with room to spare, so the deltas of a stream
concatenate to ``decode(all tokens)``; the final item flushes what was held back. Special tokens
(EOS, ...) decode to nothing.

Chunk output: ``{"text": delta, "token_ids": [id], "text_tokens": 1}``; final output (the text
held back, ``text_tokens`` 0) adds ``usage`` and ``finish_reason`` from the thinker. ``text_tokens``
(see ``OutputChunk``) lets a session cut the text at the answer token a barge-in keeps: the deltas
of the first n chunks are the text of the first n answer tokens (the bytes of a character that the
n-th token leaves unfinished excepted), the same n a talker chunk's ``answer_tokens`` counts.

Requests that offer tools: the thinker splits the answer into words and a function call as it goes
(``call_parser.py``: that needs per-request state, which this stage has none of) and each of its
chunks carries the result as ``parsed`` (``{"text", "function_call"}``); this stage passes it on:
``{"text": words, "token_ids": [id]}`` plus ``{"function_call": {"name", "arguments"}}`` (the
arguments' new text) when the call grew, so the words of a call never reach the client as text.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from pipeline.models import StageContext
from pipeline.models.qwen3_omni import loading
from pipeline.scheduling.base import BatchItem

DETOK_CONTEXT = 8
"""Tokens of left context per delta (>= 4, the longest UTF-8 sequence, even at one byte a token)."""

REPLACEMENT = "\ufffd"


def _stable(text: str) -> str:
    return text[:-1] if text.endswith(REPLACEMENT) else text


class TokenText:
    """Stateless text deltas of a token stream over one tokenizer (see the module doc)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def delta(self, context: list[int], token: int) -> str:
        before = _stable(self._text(context))
        return _stable(self._text(context + [token]))[len(before):]

    def flush(self, context: list[int]) -> str:
        text = self._text(context)
        return text[len(_stable(text)):]


class Detokenizer(TokenText):
    """BatchRunner for the ``decode`` stage."""

    def __init__(self, ctx: StageContext) -> None:
        source = loading.resolve(ctx.model_args)
        super().__init__(loading.load_tokenizer(source.path))

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        return [self._one(item.payload.data, item.final) for item in batch]

    def _one(self, data: dict[str, Any], final: bool) -> dict[str, Any]:
        parsed = data.get("parsed")
        if final:
            text = parsed["text"] if parsed is not None else self.flush(list(data.get("context_ids", [])))
            out = {"text": text, "text_tokens": 0,
                   **{k: data[k] for k in ("usage", "finish_reason") if k in data}}
        else:
            token = int(data["token_id"])
            text = parsed["text"] if parsed is not None else self.delta(list(data["context_ids"]), token)
            out = {"text": text, "token_ids": [token], "text_tokens": 1}
        if parsed is not None and parsed.get("function_call"):
            out["function_call"] = parsed["function_call"]
        return out
