"""Choosing the next token per batch row, with transformers' own logits processors.

A Sampling is the per-request choice of decoding (greedy or sampled, penalties, suppressed ids),
built once when a request starts and kept in its state until release. The processors run in the
order ``generate`` applies them (repetition penalty, suppression, then temperature / top-k / top-p
when sampling) and on float32 scores, as ``generate`` does, so greedy choices equal the
reference's. Rows whose Sampling has no processor are decided with one batched argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    suppress: tuple[int, ...] = ()
    seed: int | None = None


class Sampling:
    """One request's decoding rule and random generator."""

    def __init__(self, params: SamplingParams, device: str | torch.device) -> None:
        self.params = params
        procs = LogitsProcessorList()
        if params.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
        if params.suppress:
            procs.append(SuppressTokensLogitsProcessor(list(params.suppress), device=device))
        if params.do_sample:
            if params.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                procs.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                procs.append(TopPLogitsWarper(params.top_p))
        self.processors = procs
        self.generator: torch.Generator | None = None
        if params.do_sample and params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    @property
    def is_plain_greedy(self) -> bool:
        return not self.params.do_sample and not self.processors

    def pick(self, scores: torch.Tensor, history: Sequence[int]) -> int:
        """Next token for one row: ``scores`` [vocab] float32, ``history`` its earlier tokens."""
        ids = torch.tensor([list(history)], dtype=torch.long, device=scores.device)
        scores = self.processors(ids, scores[None, :])
        if not self.params.do_sample:
            return int(scores.argmax(-1))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def pick_rows(
    logits: torch.Tensor, samplings: Sequence[Sampling], histories: Sequence[Sequence[int]]
) -> list[int]:
    """Next token of every row of ``logits`` [rows, vocab]."""
    scores = logits.float()
    if all(s.is_plain_greedy for s in samplings):
        return scores.argmax(-1).tolist()
    return [s.pick(row, h) for s, row, h in zip(samplings, scores, histories)]
