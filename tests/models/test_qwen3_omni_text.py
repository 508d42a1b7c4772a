"""The decode stage's stateless incremental detokenization: deltas add up to the whole text.

Byte-level tokens split characters (é, €, 𝄞 are 2, 3 and 4 bytes here, one token a byte), and a
random model emits invalid byte sequences too; whatever the sequence, the chunks a stream yields
(each seeing only DETOK_CONTEXT tokens of context) and the final flush must concatenate to
``tokenizer.decode`` of all tokens, and no delta may show a character before its last byte arrived.
"""

from __future__ import annotations

import random

import pytest

from pipeline.models import StageContext
from pipeline.models.qwen3_omni.detokenize import DETOK_CONTEXT, Detokenizer
from pipeline.proto import StagePayload
from pipeline.scheduling.base import BatchItem
from tests.models.conftest import tiny_config


@pytest.fixture(scope="module")
def detok() -> Detokenizer:
    config = tiny_config()
    return Detokenizer(StageContext(config.stage("decode"), config.model_args))


def stream(detok: Detokenizer, tokens: list[int]) -> list[str]:
    """What the decode stage emits for a thinker stream of ``tokens``, chunk by chunk."""
    items = [
        BatchItem(StagePayload("r", {"token_id": t, "context_ids": tokens[max(0, i - DETOK_CONTEXT):i]}),
                  final=False)
        for i, t in enumerate(tokens)
    ]
    items.append(BatchItem(StagePayload("r", {"context_ids": tokens[-DETOK_CONTEXT:]}), final=True))
    return [out["text"] for out in detok.run(items)]


def test_multibyte_characters_appear_whole_and_once(detok: Detokenizer) -> None:
    text = "héllo € 𝄞 wörld"
    tokens = detok.tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) == len(text.encode())  # one token per byte: characters span tokens
    deltas = stream(detok, tokens)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "€" in deltas  # emitted once its third byte arrived, as one delta


@pytest.mark.parametrize("seed", range(5))
def test_random_tokens_concatenate_to_decode(detok: Detokenizer, seed: int) -> None:
    rng = random.Random(seed)
    vocab = len(detok.tokenizer)
    tokens = [rng.randrange(vocab) for _ in range(200)]
    expected = detok.tokenizer.decode(tokens, skip_special_tokens=True)
    assert "".join(stream(detok, tokens)) == expected
