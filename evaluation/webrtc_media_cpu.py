"""CPU of the WebRTC media stack alone: what one call costs before any session logic runs.

Two real aiortc peers in this process — the server's ``CallPeer`` (Opus decode, inbound resampling
to 16 kHz, the paced outbound track) and a client ``ClientPeer`` — exchange audio both ways
(speech in, a tone out) over loopback with no VAD, no session and no model. The process CPU over
the measuring window, halved, is the media cost of one peer: the floor under the server's CPU per
call that ``evaluation/duplex_bench.py`` reports.

    python -m evaluation.webrtc_media_cpu [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import numpy as np

from duplex.media.pcm import float_to_pcm16
from duplex.transports.webrtc.peer import CallPeer
from evaluation.bench_common import run_in_loopback_namespace, write_json
from harness.peers import LOOPBACK, ClientPeer, Recorder
from harness.mic import ScriptedMic
from harness.speech import speech

TEXT = "Hello there. Could you tell me what the weather will be like tomorrow?"


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


async def measure(seconds: float) -> dict[str, float]:
    recorder = Recorder()
    server = CallPeer("bench", LOOPBACK, recorder)
    mic = ScriptedMic()
    client = ClientPeer(mic)
    await client.connect(server)
    question = speech(TEXT, 48000, 0.3, 0.3)
    for _ in range(int(seconds / (len(question) / 48000)) + 3):
        mic.say(question)
    tone = np.sin(np.arange(int(48000 * (seconds + 5))) * 2 * np.pi * 220 / 48000) * 0.25
    server.outbound.enqueue("tone", float_to_pcm16(tone))
    await recorder.wait_for(lambda: len(recorder.audio) > 100)  # media flows both ways
    chunks_before = len(recorder.audio)
    cpu_start, wall_start = _cpu_seconds(), time.monotonic()
    await asyncio.sleep(seconds)  # the measuring window itself, not a synchronisation
    cpu, wall = _cpu_seconds() - cpu_start, time.monotonic() - wall_start
    received = sum(len(samples) for samples, _ in recorder.audio[chunks_before:]) / 16000
    await client.close()
    await server.close()
    return {
        "window_s": round(wall, 2),
        "both_peers_percent_of_a_core": round(100 * cpu / wall, 2),
        "per_peer_percent_of_a_core": round(50 * cpu / wall, 2),
        "inbound_audio_s": round(received, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.webrtc_media_cpu")
    result = asyncio.run(measure(args.seconds))
    print(f"one call's media, both peers in one process: {result['both_peers_percent_of_a_core']}% "
          f"of a core; per peer {result['per_peer_percent_of_a_core']}% "
          f"({result['inbound_audio_s']} s of audio received in {result['window_s']} s)")
    print(f"wrote {write_json('webrtc_media_cpu', result)}")


if __name__ == "__main__":
    main()
