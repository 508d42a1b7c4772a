"""A turn's camera frames as one video on the tiny Qwen3-Omni preset, against transformers itself.

A user message's images with ``image_times`` (frames and the times they were seen: what a call's
camera showed during the turn) reach the model as Qwen3-Omni reads video: ``pixel_values_videos`` in temporal
patches of two frames (an odd count repeats its last), ``<|video_pad|>`` placeholders, and rope
time positions from ``video_second_per_grid``. The eight stages run with their real runners; each
request must yield exactly the thinker tokens and every codebook of
``Qwen3OmniMoeForConditionalGeneration.generate(..., talker_do_sample=False)`` given a video built
here independently of the preprocessing stage: the frames normalised by the checkpoint's image
processor, patched by transformers' own ``Qwen2VLVideoProcessor.patchify`` (its source, run
without the torchvision its module imports), and ``video_second_per_grid`` as transformers'
processor sets it (temporal patch / fps). Requests: four frames at 2 fps with speech; three frames
at 1 fps (padded to four) with text; an image (a client's ``input_image`` item) and then a spoken
turn with a camera video (the image stays an image); an audio-only
request beside them, all in one batch. A second turn after a video turn continues the kept state
exactly.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers.image_utils import SizeDict
from transformers.models import qwen2_vl

from harness.speech import speech
from pipeline.models.qwen3_omni.reference import ReferenceOutput, reference_generate
from pipeline.proto import OmniRequest, StagePayload
from pipeline.scheduling.base import BatchItem
from tests.models.cases import four_requests, rel_l2, talker_cap, user
from tests.models.conftest import tiny_config
from tests.models.staged import Staged
from tests.models.test_qwen3_omni_conversation import Conversation, assert_same
from tests.models.test_qwen3_omni_vision import pattern

CONFIG = tiny_config()


def camera(count: int, fps: float, height: int = 72, width: int = 96) -> dict[str, Any]:
    """``count`` frames of a moving test pattern seen at ``fps``, as a message carries them."""
    return {"images": [pattern(height, width, 12 * k) for k in range(count)],
            "image_times": [100.0 + k / fps for k in range(count)]}


VIDEOS = {  # request id -> (the camera's frames and times, the rate they were filmed at)
    "video_audio": (camera(4, 2.0), 2.0),
    "video_odd": (camera(3, 1.0, 64, 64), 1.0),
    "image_video": (camera(2, 2.0), 2.0),
}


def video_requests() -> list[OmniRequest]:
    return [
        OmniRequest("video_audio", {"messages": [
            {**user(audio=speech("what am I holding up"), rate=16000), **VIDEOS["video_audio"][0]},
        ]}),
        OmniRequest("video_odd", {"messages": [
            {"role": "system", "text": "You can see the caller."},
            {"role": "user", **VIDEOS["video_odd"][0], "text": "What changed?"},
        ]}),
        OmniRequest("image_video", {"messages": [
            {"role": "user", "images": [pattern(64, 96, 5)], "text": "This is the label."},
            {**user(audio=speech("is it the one I hold"), rate=16000), **VIDEOS["image_video"][0]},
        ]}),
    ]


def transformers_patchify() -> Any:
    """``Qwen2VLVideoProcessor.patchify`` from transformers' source (its module imports
    torchvision, which does not import here; the method itself uses torch only)."""
    path = Path(inspect.getfile(qwen2_vl)).with_name("video_processing_qwen2_vl.py")
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "patchify")
    method.returns = None
    for arg in method.args.args:
        arg.annotation = None
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module([method], []), path, "exec"), namespace)  # noqa: S102 - transformers' own code
    return namespace["patchify"]


def video_inputs(processor: Any, frames: list[np.ndarray], fps: float) -> dict[str, torch.Tensor]:
    """What transformers' video processing makes of ``frames`` filmed at ``fps`` (module doc)."""
    normalised = []
    for frame in frames:
        chw = np.transpose(frame, (2, 0, 1))
        size = SizeDict(shortest_edge=processor.size["shortest_edge"], longest_edge=processor.size["longest_edge"])
        chw = processor.resize(chw, size=size, resample=processor.resample,
                               factor=processor.patch_size * processor.merge_size)
        chw = processor.normalize(processor.rescale(chw, processor.rescale_factor),
                                  processor.image_mean, processor.image_std)
        normalised.append(torch.from_numpy(np.asarray(chw, dtype=np.float32)))
    patches, t, h, w = transformers_patchify()(None, torch.stack(normalised)[None], processor.patch_size,
                                                processor.merge_size, processor.temporal_patch_size)
    return {"pixel_values_videos": patches[0], "video_grid_thw": torch.tensor([[t, h, w]]),
            "video_second_per_grid": torch.tensor([processor.temporal_patch_size / fps])}


@pytest.fixture(scope="module")
def staged() -> Staged:
    run = Staged(CONFIG)
    encoder = run.runners["image_encoder"]
    encode = encoder.run
    run.vision_calls: list[list[str]] = []

    def recording(batch: list[BatchItem]) -> Any:
        run.vision_calls.append([item.payload.request_id for item in batch
                                 if item.payload.data.get("pixel_values_videos") is not None])
        return encode(batch)

    encoder.run = recording
    for request in [*video_requests(), four_requests()[0]]:
        run.submit(request)
    run.run()
    return run


def independent(staged: Staged, request: OmniRequest) -> dict[str, torch.Tensor]:
    """The request's inputs to ``generate``: its ids, audio and images as the preprocessing stage
    made them, its video as transformers makes it (``video_inputs``)."""
    pre = staged.runners["preprocessing"]
    prepared = pre.run([BatchItem(StagePayload(request.request_id, request.inputs), True)])[0]
    if request.request_id in VIDEOS:
        clip, fps = VIDEOS[request.request_id]
        prepared.update(video_inputs(pre.images, clip["images"], fps))
    return prepared


@pytest.fixture(scope="module")
def references(staged: Staged, reference_model) -> dict[str, ReferenceOutput]:
    return {r.request_id: reference_generate(reference_model, independent(staged, r),
                                             CONFIG.stage("thinker").max_new_tokens, talker_cap(CONFIG))
            for r in [*video_requests(), four_requests()[0]]}


@pytest.mark.parametrize("rid", [*VIDEOS, "audio16k"])
def test_turns_with_video_equal_generate(staged: Staged, references: dict[str, ReferenceOutput], rid: str) -> None:
    result, ref = staged.results[rid], references[rid]
    assert result.error is None
    assert result.token_ids == ref.tokens
    codes = torch.stack(result.frames, dim=-1)
    assert codes.shape == ref.codes.shape and torch.equal(codes, ref.codes)
    audio = np.concatenate(result.audio)
    assert audio.shape == ref.waveform.shape
    assert rel_l2(audio, ref.waveform) <= 1e-4


def test_videos_are_encoded_together_and_answered_in_one_batch(staged: Staged) -> None:
    assert max(len(call) for call in staged.vision_calls) == 3
    assert max(staged.batch_sizes["thinker"]) == 4 and max(staged.batch_sizes["talker"]) == 4


def test_camera_frames_are_one_video_with_its_own_times(staged: Staged) -> None:
    """What the exactness above relies on, spelled out: four frames at 2 fps are one video of two
    grid steps 1 s (13 rope positions) apart, in ``<|video_pad|>`` rows, and no image."""
    pre, aggregate = staged.runners["preprocessing"], staged.runners["mm_aggregate"]
    request = video_requests()[0]
    prepared = pre.run([BatchItem(StagePayload("v", request.inputs), True)])[0]
    assert prepared.get("pixel_values") is None
    assert prepared["video_grid_thw"].tolist() == [[2, 4, 6]]  # 72 x 96 pixels in 16-pixel patches
    assert prepared["video_second_per_grid"].tolist() == [1.0]
    ids = prepared["input_ids"]
    video = ids == staged.runners["thinker"].mm_tokens[2]
    assert int(video.sum()) == 2 * 2 * 3
    n = int(video.sum())
    parts = {
        "preprocessing": StagePayload("v", prepared),
        "audio_encoder": StagePayload("v", {"audio_embeds": torch.zeros(int((ids == pre.audio_token_id).sum()), 64)}),
        "image_encoder": StagePayload("v", {"image_embeds": torch.zeros(0, 64), "deepstack": torch.zeros(1, 0, 64),
                                            "video_embeds": torch.zeros(n, 64),
                                            "video_deepstack": torch.zeros(1, n, 64)}),
    }
    out = aggregate.run([BatchItem(staged.merges["mm_branches"](parts), True)])[0]
    times = out["positions"][0, video]
    assert (times[6:] - times[:6]).tolist() == [13] * 6  # the second grid step, 1 s later
    assert out["deepstack"].shape == (1, n, 64)


def test_one_frame_is_patched_as_its_image() -> None:
    """An odd count repeats its last frame: a video of one frame is exactly its image's patches
    (transformers' image processor repeats an image over the temporal patch)."""
    pre = Staged(CONFIG).runners["preprocessing"]
    frame = pattern(72, 96, 7)
    as_video = pre.run([BatchItem(StagePayload("a", {"messages": [
        {"role": "user", "images": [frame], "image_times": [3.0], "text": "?"}]}), True)])[0]
    as_image = pre.run([BatchItem(StagePayload("b", {"messages": [
        {"role": "user", "images": [frame], "text": "?"}]}), True)])[0]
    assert torch.equal(as_video["pixel_values_videos"], as_image["pixel_values"])
    assert torch.equal(as_video["video_grid_thw"], as_image["image_grid_thw"])


@pytest.mark.parametrize("frames, times, error", [
    ([pattern(64, 64), pattern(32, 64)], [0, 1], "one size"),
    ([pattern(64, 64)] * 2, [1, 0], "in order"),
    ([pattern(64, 64)], [], "one time per frame"),
    ([pattern(64, 64)], 3.0, "list of seconds"),
    ([pattern(32, 32)] * 65, list(range(65)), "at most 64 video frames"),  # the stage's max_video_frames
])
def test_a_malformed_video_is_refused(frames: Any, times: Any, error: str) -> None:
    staged = Staged(CONFIG)
    staged.submit(OmniRequest("bad", {"messages": [{"role": "user", "images": frames, "image_times": times,
                                                    "text": "?"}]}))
    result = staged.run()["bad"]
    assert result.error is not None and error in str(result.error)


def test_a_later_turn_continues_the_kept_state_after_a_video(reference_model) -> None:
    conv = Conversation(Staged(CONFIG), "filmed")
    clip, fps = VIDEOS["video_audio"]
    turns = [
        {**user(audio=speech("look at this"), rate=16000), **clip},
        user(audio=speech("what colour was it"), rate=16000),
    ]
    prefilled: list[int] = []
    thinker = conv.staged.runners["thinker"]
    prefill = thinker._prefill

    def recording(slot: Any) -> Any:
        prefilled.append(slot.state.input_ids.numel())
        return prefill(slot)

    thinker._prefill = recording
    pre = conv.staged.runners["preprocessing"]
    for turn in turns:
        _, result = conv.ask(turn)
        said = [m for m in conv.messages if m["role"] == "user"]
        prepared = pre.run([BatchItem(StagePayload("x", {"messages": said}), True)])[0]
        prepared.update(video_inputs(pre.images, clip["images"], fps))
        prepared["input_ids"] = torch.tensor(conv.prompt_ids())
        ref = reference_generate(reference_model, prepared, CONFIG.stage("thinker").max_new_tokens,
                                 talker_cap(CONFIG))
        assert_same(result, ref)
        conv.answered(result.token_ids)
    assert prefilled[1] < len(conv.ids) // 2  # the second turn prefilled only what was new
