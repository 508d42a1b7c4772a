"""Images on the tiny Qwen3-Omni preset (its vision tower included), against transformers itself.

The preset's eight stages (preprocessing; audio_encoder and image_encoder; mm_aggregate, the fan-in
of the three; thinker; decode; talker; code2wav) run with their real runners and schedulers, the
requests in flight together (the image encoder encodes their images in one call, the thinker and
the talker step them as one batch). Each request must yield exactly the thinker tokens and every
codebook of ``Qwen3OmniMoeForConditionalGeneration.generate(..., talker_do_sample=False)`` given
the same ``pixel_values`` and ``image_grid_thw`` (and audio), run on that request alone, and the
streamed waveform the reference's one-shot code2wav of those frames: one image with text; audio
with two images of different shapes after a system prompt; four frames of a moving test pattern;
and an audio-only request beside them; also beside a request aborted mid-answer. A conversation
whose second turn refers to the first turn's image continues the kept thinker state exactly (the
rope positions after an image are not the rows' indices, and the state carries the difference),
also after a barge-in cut its answer and a turn aborted mid-answer was undone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from harness.speech import speech
from pipeline.models.qwen3_omni.reference import ReferenceOutput
from pipeline.proto import OmniRequest, StagePayload
from pipeline.scheduling.base import BatchItem
from tests.models.cases import four_requests, reference_for, rel_l2, user
from tests.models.conftest import tiny_config
from tests.models.staged import Staged
from tests.models.test_qwen3_omni_conversation import Conversation, assert_same

CONFIG = tiny_config()


def pattern(height: int, width: int, shift: int = 0) -> np.ndarray:
    """A colour test pattern (bars and a diagonal ramp), moved ``shift`` pixels to the right."""
    y, x = np.mgrid[0:height, 0:width]
    x = (x - shift) % width
    rgb = np.stack([(x * 255 // width), (y * 255 // height), ((x + y) * 7) % 256], axis=-1)
    return rgb.astype(np.uint8)


def image_requests() -> list[OmniRequest]:
    return [
        OmniRequest("image", {"messages": [
            {"role": "user", "images": [pattern(96, 160)], "text": "What is in this picture?"},
        ]}),
        OmniRequest("image_audio", {"messages": [
            {"role": "system", "text": "You can see and hear."},
            {**user(audio=speech("what do you see here"), rate=16000),
             "images": [pattern(64, 64, 9), pattern(200, 120, 3)]},
        ]}),
        OmniRequest("frames", {"messages": [
            {"role": "user", "images": [pattern(80, 128, 16 * k) for k in range(4)], "text": "Describe it."},
        ]}),
    ]


@pytest.fixture(scope="module")
def staged() -> Staged:
    run = Staged(CONFIG)
    encoder = run.runners["image_encoder"]
    encode = encoder.run
    run.image_batches: list[int] = []

    def recording(batch: list[BatchItem]) -> Any:
        run.image_batches.append(sum(item.payload.data.get("pixel_values") is not None for item in batch))
        return encode(batch)

    encoder.run = recording
    for request in [*image_requests(), four_requests()[0]]:
        run.submit(request)
    run.run()
    return run


@pytest.fixture(scope="module")
def references(staged: Staged, reference_model) -> dict[str, ReferenceOutput]:
    preprocessing = staged.runners["preprocessing"]
    return {r.request_id: reference_for(reference_model, preprocessing, r, CONFIG)
            for r in [*image_requests(), four_requests()[0]]}


@pytest.mark.parametrize("rid", ["image", "image_audio", "frames", "audio16k"])
def test_turns_with_images_equal_generate(staged: Staged, references: dict[str, ReferenceOutput],
                                          rid: str) -> None:
    result, ref = staged.results[rid], references[rid]
    assert result.error is None
    assert result.token_ids == ref.tokens
    codes = torch.stack(result.frames, dim=-1)
    assert codes.shape == ref.codes.shape and torch.equal(codes, ref.codes)
    audio = np.concatenate(result.audio)
    assert audio.shape == ref.waveform.shape
    assert rel_l2(audio, ref.waveform) <= 1e-4


def test_images_are_encoded_together_and_answered_in_one_batch(staged: Staged) -> None:
    assert max(staged.image_batches) == 3  # the three requests with images, in one tower call
    assert max(staged.batch_sizes["thinker"]) == 4 and max(staged.batch_sizes["talker"]) == 4


def test_image_rows_take_3d_positions(staged: Staged) -> None:
    """What the exactness above relies on: the fan-in gives an image prompt positions that are not
    its rows' indices (a 2-D grid per image), and an audio-only prompt none."""
    pre, aggregate = staged.runners["preprocessing"], staged.runners["mm_aggregate"]
    image, audio = image_requests()[0], four_requests()[0]
    prepared = {r.request_id: pre.run([BatchItem(StagePayload(r.request_id, r.inputs), True)])[0]
                for r in (image, audio)}
    grid = prepared["image"]["image_grid_thw"]
    assert grid.tolist() == [[1, 6, 10]]  # 96 x 160 pixels in 16-pixel patches
    n_image = int(grid.prod()) // 4
    parts = {
        "preprocessing": StagePayload("image", prepared["image"]),
        "audio_encoder": StagePayload("image", {"audio_embeds": torch.zeros(0, 64)}),
        "image_encoder": StagePayload("image", {"image_embeds": torch.zeros(n_image, 64),
                                                "deepstack": torch.zeros(1, n_image, 64)}),
    }
    merged = staged.merges["mm_branches"](parts)
    out = aggregate.run([BatchItem(merged, True)])[0]
    ids = prepared["image"]["input_ids"]
    positions = out["positions"]
    rows = (ids == staged.runners["thinker"].image_token).nonzero()[:, 0]
    assert positions.shape == (3, ids.numel())
    assert positions[1, rows].unique().numel() == 3 and positions[2, rows].unique().numel() == 5
    assert int(positions.max()) + 1 < ids.numel()  # the text after the image starts earlier
    assert out["mm_embeds"].shape[0] == n_image and out["deepstack"].shape == (1, n_image, 64)


def test_a_placeholder_without_its_embedding_fails_the_request(staged: Staged) -> None:
    image = image_requests()[0]
    prepared = staged.runners["preprocessing"].run([BatchItem(StagePayload("x", image.inputs), True)])[0]
    parts = {
        "preprocessing": StagePayload("x", prepared),
        "audio_encoder": StagePayload("x", {"audio_embeds": torch.zeros(0, 64)}),
        "image_encoder": StagePayload("x", {"image_embeds": torch.zeros(3, 64), "deepstack": torch.zeros(1, 3, 64)}),
    }
    with pytest.raises(Exception, match="15 image placeholders but 3 image embeddings"):
        staged.runners["mm_aggregate"].run([BatchItem(staged.merges["mm_branches"](parts), True)])


def test_a_later_turn_continues_the_kept_state_after_an_image(reference_model) -> None:
    conv = Conversation(Staged(CONFIG), "seen")
    turns = [
        {"role": "user", "images": [pattern(96, 160)], "text": "Look at this."},
        user(audio=speech("what colour was it"), rate=16000),
    ]
    prefilled: list[int] = []
    thinker = conv.staged.runners["thinker"]
    prefill = thinker._prefill

    def recording(slot: Any) -> Any:
        prefilled.append(slot.state.input_ids.numel())
        return prefill(slot)

    thinker._prefill = recording
    for turn in turns:
        _, result = conv.ask(turn)
        assert_same(result, conv.reference(reference_model))
        conv.answered(result.token_ids)
    assert prefilled[1] < len(conv.ids) // 2  # the second turn prefilled only what was new


def test_a_cut_and_an_undone_turn_after_an_image_keep_its_positions(reference_model) -> None:
    """A barge-in cuts the answer to an image turn (the kept state keeps the answer's rope offset),
    a turn aborted mid-answer is undone (back to the offset before it), and the next turn from the
    kept state still equals ``generate`` over that history."""
    conv = Conversation(Staged(CONFIG), "seen-cut")
    thinker = conv.staged.schedulers["thinker"]
    rid, first = conv.ask({"role": "user", "images": [pattern(96, 160)], "text": "Look at this."})
    kept = len(first.token_ids) // 2
    thinker.abort_conversation(rid, conv.cid, kept)
    conv.answered(first.token_ids[:kept])
    size = thinker.conversation_sizes()[conv.cid]
    conv.messages.append(user(audio=speech("and this"), rate=16000))
    request = conv.book.begin(
        OmniRequest("seen-aborted", {"messages": list(conv.messages)}, {"conversation_id": conv.cid}))
    conv.staged.submit(request)
    for _ in range(4):
        conv.staged.step()
    conv.staged.abort("seen-aborted")
    thinker.abort_conversation("seen-aborted", conv.cid, None)
    conv.book.end("seen-aborted", "aborted", None)
    conv.messages.pop()
    assert thinker.conversation_sizes() == {conv.cid: size}
    _, second = conv.ask(user(audio=speech("what colour was it"), rate=16000))
    assert_same(second, conv.reference(reference_model))


def test_image_turns_beside_an_abort_stay_exact(references: dict[str, ReferenceOutput]) -> None:
    """A request aborted mid-answer (its images encoded, its rows in the batch) changes nothing for
    the image requests stepped beside it, and leaves no stage holding it."""
    run = Staged(CONFIG)
    image, image_audio, frames = image_requests()
    for request in (image, OmniRequest("gone", frames.inputs), image_audio):
        run.submit(request)
    for _ in range(6):
        run.step()
    assert run.results["gone"].token_ids  # it was answering when aborted
    run.abort("gone")
    run.run()
    for rid in ("image", "image_audio"):
        result, ref = run.results[rid], references[rid]
        assert result.error is None and result.token_ids == ref.tokens
        assert torch.equal(torch.stack(result.frames, dim=-1), ref.codes)
    assert all(scheduler.live_requests() == 0 for scheduler in run.schedulers.values())
