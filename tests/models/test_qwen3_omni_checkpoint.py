"""The tiny checkpoint: deterministic from its seed, safe to build concurrently, loaded through the
same ``from_pretrained`` path as a hub checkpoint, component by component."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from pipeline.models.qwen3_omni import loading, tiny


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("duplex-cache")


def test_concurrent_builders_share_one_complete_checkpoint(cache: Path, monkeypatch) -> None:
    monkeypatch.setenv("DUPLEX_CACHE_DIR", str(cache))
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(tiny.ensure_tiny_checkpoint(5))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1
    assert sorted(p.name for p in cache.iterdir()) == [paths[0].name]  # no temporary dir left
    assert tiny.is_tiny_checkpoint(paths[0])


def test_the_seed_fixes_the_weights(cache: Path, tiny_source: loading.Source, monkeypatch) -> None:
    monkeypatch.setenv("DUPLEX_CACHE_DIR", str(cache))
    again = tiny.ensure_tiny_checkpoint(0)
    assert again != Path(tiny_source.path)  # built anew into this cache...
    ours, theirs = load_file(str(again / "model.safetensors")), load_file(
        str(Path(tiny_source.path) / "model.safetensors")
    )
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)  # ...with the same weights


def test_components_load_the_checkpoint_weights(tiny_source: loading.Source, reference_model) -> None:
    """Each stage's component, loaded alone with its key mapping, holds exactly the weights of the
    composite model (the talker's MoE experts included, fused on load)."""
    parts = {
        "thinker": (loading.load_thinker(tiny_source, "cpu"), reference_model.thinker),
        "audio_encoder": (loading.load_audio_encoder(tiny_source, "cpu"), reference_model.thinker.model.audio_tower),
        "talker": (loading.load_talker(tiny_source, "cpu"), reference_model.talker),
        "code2wav": (loading.load_code2wav(tiny_source, "cpu"), reference_model.code2wav),
    }
    for name, (part, whole) in parts.items():
        expected = whole.state_dict()
        got = part.state_dict()
        assert got, name
        assert all(torch.equal(v, expected[k]) for k, v in got.items()), name


def test_startup_says_the_weights_are_random(tiny_source: loading.Source) -> None:
    assert "RANDOM weights" in loading.describe(tiny_source)
    assert "RANDOM" not in loading.describe(loading.Source("Qwen/Qwen3-Omni-30B-A3B-Instruct", torch.bfloat16))


def test_a_processor_chat_template_serves_when_the_tokenizer_has_none(
    tiny_source: loading.Source, tmp_path: Path
) -> None:
    """Checkpoints may keep the template beside the processor (chat_template.json): the loader
    falls back to it, since the processor itself cannot load here."""
    copy = tmp_path / "checkpoint"
    shutil.copytree(tiny_source.path, copy)
    template = (copy / "chat_template.jinja").read_text()
    (copy / "chat_template.jinja").unlink()
    (copy / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert AutoTokenizer.from_pretrained(copy).chat_template is None
    assert loading.load_tokenizer(str(copy)).chat_template == template
