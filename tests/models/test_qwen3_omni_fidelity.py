"""Streaming equals batch (DESIGN.md invariant 8) for Qwen3-Omni, against transformers itself.

Four different requests (audio at 16 and 48 kHz, text only, a multi-turn history with a system
prompt) run through the tiny preset's real runners and schedulers, thinker and talker stepping them
as one batch; each must yield exactly the thinker tokens and the codec frames (every codebook) of
``Qwen3OmniMoeForConditionalGeneration.generate(..., talker_do_sample=False)`` on the same weights,
inputs and caps, run on that request alone; the streamed waveform must equal the reference's
one-shot code2wav of those frames.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pipeline.models.qwen3_omni import loading
from pipeline.models.qwen3_omni.reference import ReferenceOutput
from tests.models.cases import REQUEST_IDS, four_requests, reference_for, rel_l2, talker_cap
from tests.models.conftest import tiny_config
from tests.models.staged import Result, Staged

CONFIG = tiny_config()


# The random thinker never says EOS within its cap, so every answer would end on the cap. The "eos"
# scenario moves the thinker's EOS (in the runner and in the reference alike) to a token this model
# emits early for some of the requests, so that answers of several lengths end on EOS too.
EMITTED_TOKEN = 131


@pytest.fixture(scope="module", params=["cap", "eos"])
def eos(request: pytest.FixtureRequest, reference_model) -> Iterator[int]:
    original = reference_model.config.im_end_token_id
    token = original if request.param == "cap" else EMITTED_TOKEN
    reference_model.config.im_end_token_id = token
    try:
        yield token
    finally:
        reference_model.config.im_end_token_id = original


@pytest.fixture(scope="module")
def staged(eos: int) -> Staged:
    run = Staged(CONFIG)
    run.runners["thinker"].eos = eos
    for request in four_requests():
        run.submit(request)
    run.run()
    return run


@pytest.fixture(scope="module")
def references(staged: Staged, reference_model) -> dict[str, ReferenceOutput]:
    preprocessing = staged.runners["preprocessing"]
    return {
        r.request_id: reference_for(reference_model, preprocessing, r, CONFIG) for r in four_requests()
    }


def test_answers_end_on_eos_and_on_caps(references: dict[str, ReferenceOutput], eos: int) -> None:
    """The scenarios cover what they claim: in "eos" answers of several lengths end on the
    thinker's EOS; in "cap" every answer ends on the thinker's cap, and the talker ends some on
    codec EOS and others on its text-tied cap."""
    thinker_cap = CONFIG.stage("thinker").max_new_tokens
    lengths = {len(r.tokens) for r in references.values()}
    if eos == EMITTED_TOKEN:
        assert len(lengths) >= 3 and min(lengths) < thinker_cap
        return
    assert lengths == {thinker_cap}
    cap = talker_cap(CONFIG)
    frames = {rid: (r.codes.shape[1], cap(len(r.tokens)) - 1) for rid, r in references.items()}
    assert any(n < limit for n, limit in frames.values())
    assert any(n == limit for n, limit in frames.values())


def test_thinker_and_talker_step_the_requests_as_one_batch(staged: Staged) -> None:
    assert max(staged.batch_sizes["thinker"]) == 4
    assert max(staged.batch_sizes["talker"]) == 4
    assert len(staged.runners["thinker"].pool) == len(staged.runners["talker"].pool) == 0


def test_an_abort_mid_batch_frees_its_kv_and_spares_the_others(
    references: dict[str, ReferenceOutput], eos: int
) -> None:
    """A request leaves the batch at an abort (its KV rows cut out) while another joins it late;
    the requests that stay still equal generate, and every cache is freed at the end."""
    run = Staged(CONFIG)
    run.runners["thinker"].eos = eos
    first, _, victim, late = four_requests()  # the victim's answer is long in both scenarios
    run.submit(first)
    run.submit(victim)
    while len(run.results[victim.request_id].token_ids) < 2:
        run.step()
    assert len(run.runners["thinker"].pool) == 2
    run.abort(victim.request_id)
    run.submit(late)
    run.run()
    assert len(run.runners["thinker"].pool) == len(run.runners["talker"].pool) == 0
    for request in (first, late):
        got, ref = run.results[request.request_id], references[request.request_id]
        assert got.token_ids == ref.tokens
        assert torch.equal(torch.stack(got.frames, dim=1), ref.codes)


@pytest.mark.parametrize("rid", REQUEST_IDS)
def test_tokens_and_frames_equal_generate(
    staged: Staged, references: dict[str, ReferenceOutput], rid: str
) -> None:
    got: Result = staged.results[rid]
    ref = references[rid]
    assert got.error is None
    assert got.token_ids == ref.tokens
    assert len(got.frames) == ref.codes.shape[1]
    assert torch.equal(torch.stack(got.frames, dim=1), ref.codes)


@pytest.mark.parametrize("rid", REQUEST_IDS)
def test_streamed_text_and_audio_equal_generate(
    staged: Staged, references: dict[str, ReferenceOutput], rid: str, tiny_source
) -> None:
    got = staged.results[rid]
    ref = references[rid]
    tokenizer = loading.load_tokenizer(tiny_source.path)
    assert got.text == tokenizer.decode(ref.tokens, skip_special_tokens=True)
    audio = np.concatenate(got.audio)
    assert audio.shape == ref.waveform.shape
    assert rel_l2(audio, ref.waveform) <= 1e-4
    assert got.finals == {"decode", "code2wav", "transcribe"}
