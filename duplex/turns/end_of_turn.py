"""The end-of-turn model: how likely it is that the user has finished, from the turn's audio.

:class:`EndOfTurnModel` combines two cues into one probability (the policy in
:mod:`duplex.turns.semantic_policy` decides what to do with it):

- smart-turn v3.2 (Daily's pipecat project, BSD 2-Clause), an ONNX audio classifier on a
  Whisper-tiny encoder that the ``pipecat-ai`` wheel ships as package data. It hears the last 8 s
  of the turn and gives P(finished) from intonation and rhythm, not words, so it cannot tell a
  finished phone number from a half-read one. On synthetic speech its answer is fragile: sox's
  -90 dB dither alone moved it by up to 0.3;
- the pitch fall over the last words (:mod:`duplex.turns.prosody`): speakers lower their pitch
  when they finish a statement and keep it level when they pause mid-phrase.

Decision rule: ``logit(P) = W_MODEL * logit(smart_turn) + W_FALL * pitch_fall + BIAS`` (a logistic
regression; a missing pitch counts as no fall). ``W_FALL`` and ``BIAS`` are fitted by
``python -m evaluation.turn_eval --tune`` on its spoken set. There the pitch fall separates
finished turns from mid-sentence pauses with an AUC of ~0.8 in espeak-ng's voices but not in
piper's (~0.66 over both), so its fitted weight is small. smart-turn scores ~0.5 on both (chance:
synthetic prosody is nothing like the human speech it was trained on), so the fit gives it no
weight; ``W_MODEL`` is a prior instead, small enough that the model alone never ends a turn yet
lets a confident model speed up real, human turns. The words carry most of the signal: the text
cue is the third term, once the words are known (:func:`with_text`): where the pipeline
recognises speech, the speculative request begun at the pause brings back the transcript and a
language model's P(finished) for it (``input_end_of_turn``: ``pipeline/models/offline/
finished_text.py``), and ``logit(P') = logit(P) + W_TEXT * logit(text) + TEXT_BIAS``, fitted on
the same set with the audio terms as a fixed offset, over the pauses whose words read as finished
(the policy adds the term there only: ``semantic_policy.probability_with_words``). Alone, the
judgement separates finished turns from mid-sentence pauses with an AUC of ~0.89.

Input: 16 kHz mono float32 audio of the turn up to now, trailing silence included (the model was
trained on turns that end a short silence after the last word). Longer than 8 s: only the last 8 s
count. Shorter: padded with silence in front, as the model was trained. Features are Whisper's
log-mel spectrogram with per-clip normalisation, as ``transformers``' ``WhisperFeatureExtractor``
with ``chunk_length=8`` computes them (80 mel bins x 800 frames), in numpy
(:mod:`duplex.turns.whisper_features`: that class imports torch).

Cost: smart-turn is a fixed 8 s of features (~15 ms) plus the encoder (~55 ms on one core of
this 2-core machine when quiet, 100-250 ms when its cores are shared), the same however short the
turn; the pitch cue ~2 ms. Call it only at pauses, never per window, and off the event loop
(numpy, torch and onnxruntime release the GIL for the heavy parts).

State: none per session. The ONNX session and the feature extractor are loaded once per process
(:func:`shared_model`) and shared by every session and thread (``InferenceSession.run`` is
thread-safe; the extractor keeps only constants). Nothing is downloaded: the weights come from
the installed ``pipecat-ai`` wheel (``pip install --no-deps pipecat-ai``; we import none of its
code). Where it is missing, :func:`require_model` says which package to install, and a preset or a
``session.update`` that asks for semantic_vad is refused with that message.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duplex.turns.prosody import final_pitch_fall
from duplex.turns.whisper_features import WhisperLogMel

log = logging.getLogger(__name__)

SAMPLE_RATE = 16000
WINDOW_S = 8  # the model's input: the last 8 s of the turn
_DISTRIBUTION = "pipecat-ai"
_MODEL_FILE = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
# Weights only: none of pipecat's code or dependencies is used (pyproject.toml's offline extra).
_INSTALL = f"pip install --no-deps {_DISTRIBUTION}==1.14.0"

W_MODEL = 0.25  # prior (see module doc)
W_TEXT = 1.27  # fitted (module doc) over the pauses whose words read as finished sentences
TEXT_BIAS = 4.39
W_FALL = -1.05  # per unit of log pitch ratio: a fall of 0.2 (3.5 semitones) adds +0.2
BIAS = 0.58
_CLIP = 1e-3  # smart-turn answers 0.999..., the text judge 0.0001: keep logits finite


@dataclass(frozen=True)
class Cues:
    """What the end-of-turn decision is made from, for one pause."""

    smart_turn: float  # smart-turn v3.2's P(finished)
    pitch_fall: float | None  # log pitch ratio over the last words; None when unvoiced

    def probability(
        self, w_model: float = W_MODEL, w_fall: float = W_FALL, bias: float = BIAS
    ) -> float:
        """The combined P(finished) (module doc); the weights are parameters for tuning."""
        z = w_model * logit(self.smart_turn) + w_fall * (self.pitch_fall or 0.0) + bias
        return _sigmoid(z)


def with_text(
    p_audio: float, finished_text: float | None, w_text: float = W_TEXT, bias: float = TEXT_BIAS
) -> float:
    """The end-of-turn probability once the words' own, ``finished_text``, is in (the third
    term, module doc); ``p_audio`` alone while it is not. The weights are parameters for tuning."""
    if finished_text is None:
        return p_audio
    return _sigmoid(logit(p_audio) + w_text * logit(finished_text) + bias)


def logit(p: float) -> float:
    """log(p / (1 - p)), ``p`` clipped to [_CLIP, 1 - _CLIP] as every cue is (the tuning too)."""
    p = min(max(p, _CLIP), 1 - _CLIP)
    return math.log(p / (1 - p))


def _sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


class ModelNotInstalled(RuntimeError):
    """The wheel that ships the model's weights is missing."""


def model_path() -> Path:
    """Where the installed ``pipecat-ai`` wheel keeps smart-turn v3.2's ONNX file; raises
    :class:`ModelNotInstalled`, naming the package to install, where it is missing.

    Found through the distribution's file list rather than ``importlib.resources``: that would
    import the ``pipecat`` package and its dependencies, none of which we use.
    """
    needs = f"semantic_vad needs its end-of-turn model, smart-turn v3.2, from {_DISTRIBUTION}"
    try:
        distribution = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelNotInstalled(f"{needs}, not installed here: {_INSTALL}") from exc
    path = Path(str(distribution.locate_file(_MODEL_FILE)))
    if not path.is_file():
        raise ModelNotInstalled(f"{needs}, but {_DISTRIBUTION} {distribution.version} has no "
                                f"{_MODEL_FILE}: {_INSTALL}")
    return path


def require_model(turn_detection_type: str) -> None:
    """Raise :class:`ModelNotInstalled`, naming the package, where ``turn_detection_type`` needs
    this model (semantic_vad) and it is missing: a setting refused up front, where it is chosen,
    rather than one that fails at every pause of every turn."""
    if turn_detection_type == "semantic_vad":
        model_path()


class EndOfTurnModel:
    """smart-turn v3.2 on onnxruntime (see module doc); stateless, shared by all sessions."""

    def __init__(self, path: Path | None = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        # One thread: a call is short and sessions run side by side; more threads per call only
        # fight the media path and the other sessions for the same cores.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        path = path or model_path()
        self._session = ort.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._input = self._session.get_inputs()[0].name
        self._features = WhisperLogMel()
        log.info("end-of-turn model loaded from %s", path)

    def probability(self, audio: np.ndarray) -> float:
        """P(the user has finished) from the turn's 16 kHz float32 mono audio up to now (the
        words, when they come, are added by :func:`with_text`)."""
        return self.cues(audio).probability()

    def cues(self, audio: np.ndarray) -> Cues:
        """Both cues for the turn's audio up to now (see :meth:`probability`)."""
        return Cues(self.smart_turn(audio), final_pitch_fall(audio))

    def smart_turn(self, audio: np.ndarray) -> float:
        """smart-turn v3.2's own P(finished) for the turn's audio up to now."""
        samples = WINDOW_S * SAMPLE_RATE
        clip = np.asarray(audio, dtype=np.float32)[-samples:]
        # Silence in front, not behind: the end of the turn must sit at the end of the window.
        clip = np.pad(clip, (samples - len(clip), 0))
        features = self._features(clip)
        # The graph's output is named "logits" but already holds sigmoid probabilities.
        (output,) = self._session.run(None, {self._input: features})
        return float(output[0, 0])


@functools.cache
def shared_model() -> EndOfTurnModel:
    """The process's one :class:`EndOfTurnModel`, loaded on first use (~0.1 s, ~9 MB)."""
    return EndOfTurnModel()
