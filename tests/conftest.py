"""Suite-wide settings and fixtures: CTranslate2 loaded early (below); quiet chatty libraries in
captured logs; the offline preset's recogniser (Whisper tiny.en), loaded once for every module
that judges speech by its words."""

import logging

# Early, before the test modules load their native libraries: which ones are loaded before
# CTranslate2 changes what its int8 kernels compute. Measured: Whisper tiny.en on
# tests/media/test_noise_babble.py's babble clip heard the question at WER 0.25 with CTranslate2
# (or torch) loaded first, 0.5-0.625 with onnxruntime loaded before it; the offline preset's stage
# processes load torch first (pipeline/runner.py), so tests hear as its recogniser does.
import ctranslate2  # noqa: F401  (loaded for its side effect, above)
import pytest

from pipeline.models.offline.asr import Transcriber
from pipeline.models.offline.sources import asr_model_dir

for _name in ("httpx", "aioice.ice", "httpcore"):
    logging.getLogger(_name).setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def transcriber() -> Transcriber:
    """Whisper tiny.en on one thread, as tests hear speech: shared, stateless between calls."""
    return Transcriber(asr_model_dir("packaged"), threads=1)
