"""CPU per session of the inbound audio path: VAD (silero ONNX + turn detection) and resampling.

Feeds real espeak-ng speech, 20 ms at a time as a WebRTC call delivers it, and prints the CPU time
(this thread's) per second of audio as a percentage of one core. DESIGN.md's budget for the VAD is
1% of one core per session.

Beside each path it measures the one it replaced, in the same run, alternating in short rounds so
that a busy machine slows both alike: the VAD through silero's own torch wrapper around the same
ONNX model, and the inbound resampling as two steps (numpy channel average, then PyAV). Each line
gives the median and the range over the rounds.

    python -m evaluation.vad_cpu [--seconds 60] [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import time
import warnings
from collections.abc import Callable

import av
import numpy as np

from duplex.media.pcm import float_to_pcm16
from duplex.media.resample import FrameResampler, Resampler
from duplex.turns import vad as vad_module
from duplex.turns.server_vad import TurnDetector
from evaluation.bench_common import write_json
from harness.speech import speech

TEXT = ("I would like to know whether the train to the airport leaves on time tomorrow morning, "
        "and whether I can bring a bicycle on board.")


def opus_like_frames(samples_48k: np.ndarray) -> list[av.AudioFrame]:
    pcm = float_to_pcm16(samples_48k)
    stereo = np.repeat(pcm, 2)
    frames = []
    for start in range(0, len(pcm) - 959, 960):
        frame = av.AudioFrame.from_ndarray(stereo[2 * start : 2 * (start + 960)].reshape(1, -1),
                                           format="s16", layout="stereo")
        frame.sample_rate = 48000
        frames.append(frame)
    return frames


def cpu_percent(work: Callable[[], object], audio_seconds: float) -> float:
    start = time.thread_time()
    work()
    return 100 * (time.thread_time() - start) / audio_seconds


class SileroWrapperStream:
    """The VAD as it was: silero's OnnxWrapper (torch tensors around each call), same model."""

    def __init__(self) -> None:
        import torch

        threads = torch.get_num_threads()
        import silero_vad  # sets torch's threads to 1 process-wide: undone below

        torch.set_num_threads(threads)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._model = copy.copy(silero_vad.load_silero_vad(onnx=True, opset_version=15))
        self._model.reset_states()
        self._torch = torch

    def probability(self, window: np.ndarray) -> float:
        return float(self._model(self._torch.from_numpy(window), 16000))


class TwoStepResampler:
    """The inbound resampling as it was: average the channels in numpy, then resample mono s16."""

    def __init__(self) -> None:
        self._resampler = Resampler(48000, 16000, in_dtype=np.int16, in_channels=2)

    def push(self, frame: av.AudioFrame) -> np.ndarray:
        return self._resampler.push(frame.to_ndarray().reshape(-1, 2))


def _detect(detector: TurnDetector, chunks: list[np.ndarray], events: list[object]) -> None:
    for chunk in chunks:
        events.extend(detector.process(chunk))


def _resample(resampler: FrameResampler | TwoStepResampler, frames: list[av.AudioFrame]) -> None:
    for frame in frames:
        resampler.push(frame)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(float(np.median(values)), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    utterance = speech(TEXT, 16000, 0.5, 1.0)
    repeats = int(np.ceil(args.seconds * 16000 / len(utterance)))
    audio16 = np.tile(utterance, repeats)[: int(args.seconds * 16000)]
    frames = opus_like_frames(np.tile(speech(TEXT, 48000, 0.5, 1.0), repeats))[
        : int(args.seconds * 50)]
    chunks = [audio16[i : i + 320] for i in range(0, len(audio16), 320)]
    per_round = args.seconds / args.rounds
    round_chunks, round_frames = len(chunks) // args.rounds, len(frames) // args.rounds

    wrapper = SileroWrapperStream()  # both models load outside the measurement
    detectors = {"direct": TurnDetector(), "wrapper": TurnDetector()}
    detectors["wrapper"]._vad = wrapper  # the same turn logic on the old model path
    resamplers = {"one_call": FrameResampler(16000), "two_step": TwoStepResampler()}
    turns: dict[str, list[object]] = {name: [] for name in detectors}
    vad_cpu: dict[str, list[float]] = {name: [] for name in detectors}
    resample_cpu: dict[str, list[float]] = {name: [] for name in resamplers}
    for r in range(args.rounds):
        part = chunks[r * round_chunks : (r + 1) * round_chunks]
        for name, detector in detectors.items():
            work = functools.partial(_detect, detector, part, turns[name])
            vad_cpu[name].append(cpu_percent(work, per_round))
        batch = frames[r * round_frames : (r + 1) * round_frames]
        for name, resampler in resamplers.items():
            resample_cpu[name].append(cpu_percent(functools.partial(_resample, resampler, batch),
                                                  per_round))

    result = {
        "audio_seconds": args.seconds,
        "rounds": args.rounds,
        "vad_cpu_percent_of_one_core": {
            "onnxruntime_direct": _spread(vad_cpu["direct"]),
            "silero_torch_wrapper": _spread(vad_cpu["wrapper"]),
        },
        "inbound_resample_cpu_percent_of_one_core": {
            "one_call": _spread(resample_cpu["one_call"]),
            "two_step": _spread(resample_cpu["two_step"]),
        },
        "turn_events": {name: len(events) for name, events in turns.items()},
        "vad_model": str(vad_module.model_path().name),
    }
    print(json.dumps(result, indent=2))
    print(f"wrote {write_json('vad_cpu', result)}")


if __name__ == "__main__":
    main()
