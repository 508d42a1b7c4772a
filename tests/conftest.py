"""Suite-wide settings and fixtures: quiet chatty libraries in captured logs; the offline preset's
recogniser (Whisper tiny.en), loaded once for every module that judges speech by its words."""

import logging

import pytest

from pipeline.models.offline.asr import Transcriber
from pipeline.models.offline.sources import asr_model_dir

for _name in ("httpx", "aioice.ice", "httpcore"):
    logging.getLogger(_name).setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def transcriber() -> Transcriber:
    """Whisper tiny.en on one thread, as tests hear speech: shared, stateless between calls."""
    return Transcriber(asr_model_dir("packaged"), threads=1)
