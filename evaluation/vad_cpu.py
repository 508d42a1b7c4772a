"""CPU per session of the inbound audio path: VAD (silero ONNX + turn detection) and resampling.

Feeds real espeak-ng speech, 20 ms at a time as a WebRTC call delivers it, and prints the CPU time
(process time, one thread) per second of audio as a percentage of one core. DESIGN.md's budget for
the VAD is 1% of one core per session.

    python -m evaluation.vad_cpu [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import time

import av
import numpy as np

from duplex.media.pcm import float_to_pcm16
from duplex.media.resample import FrameResampler
from duplex.turns.server_vad import TurnDetector
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


def cpu_percent(work, audio_seconds: float) -> float:
    start = time.process_time()
    work()
    return 100 * (time.process_time() - start) / audio_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()

    utterance = speech(TEXT, 16000, 0.5, 1.0)
    repeats = int(np.ceil(args.seconds * 16000 / len(utterance)))
    audio16 = np.tile(utterance, repeats)[: int(args.seconds * 16000)]
    frames = opus_like_frames(np.tile(speech(TEXT, 48000, 0.5, 1.0), repeats))[
        : int(args.seconds * 50)]
    chunks = [audio16[i : i + 320] for i in range(0, len(audio16), 320)]

    detector = TurnDetector()  # loads the model outside the measurement
    turns = []

    def vad() -> None:
        for chunk in chunks:
            turns.extend(detector.process(chunk))

    def resample() -> None:
        resampler = FrameResampler(16000)
        for frame in frames:
            resampler.push(frame)

    result = {
        "audio_seconds": args.seconds,
        "vad_cpu_percent_of_one_core": round(cpu_percent(vad, args.seconds), 3),
        "inbound_resample_cpu_percent_of_one_core": round(cpu_percent(resample, args.seconds), 3),
        "turn_events": len(turns),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
