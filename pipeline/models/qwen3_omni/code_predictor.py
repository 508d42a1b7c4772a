"""The talker's code predictor: the residual codebooks of one codec frame, for a batch of rows.

For each frame the reference runs a fresh generation of ``num_code_groups - 1`` tokens from
``[past_hidden, embed(code0)]`` (positions from 0): residual k comes from ``lm_head[k-1]`` and is
fed back through ``codec_embedding[k-1]``. Every row has the same length at every step, so the
whole batch runs without padding. The talker's next input is the sum of all codebook embeddings of
the frame, computed with the same ops as the reference (one concatenation, one sum).

Nothing here outlives a call: the cache is created and dropped per frame.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from pipeline.models.qwen3_omni.sampling import Sampling, pick_rows


def predict_frame(
    talker: torch.nn.Module,
    past_hidden: torch.Tensor,
    code0: torch.Tensor,
    samplings: Sequence[Sampling],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [rows, groups] of the frames whose first code is ``code0`` [rows], and the embedding
    sum [rows, 1, hidden] that feeds the talker's next step.

    ``past_hidden`` [rows, 1, hidden] is the talker's post-norm hidden state that produced code0.
    """
    predictor = talker.code_predictor
    embeddings = predictor.model.codec_embedding
    groups = talker.config.num_code_groups
    code0_embed = talker.get_input_embeddings()(code0[:, None])
    inputs = torch.cat((past_hidden, code0_embed), dim=1)
    cache = DynamicCache(config=predictor.config)
    codes = [code0]
    fed: list[torch.Tensor] = [code0_embed]
    no_history: list[list[int]] = [[] for _ in samplings]
    for k in range(1, groups):
        out = predictor.model(inputs_embeds=inputs, cache=cache, use_cache=True)
        logits = predictor.lm_head[k - 1](out.last_hidden_state)[:, -1]
        code = torch.tensor(pick_rows(logits, samplings, no_history), device=code0.device)
        codes.append(code)
        inputs = embeddings[k - 1](code[:, None])
        fed.append(inputs)
    return torch.stack(codes, dim=1), torch.cat(fed, dim=1).sum(1, keepdim=True)
