"""CPU of the WebRTC media stack alone: what one call costs before any session logic runs.

Two real aiortc peers in this process — the server's ``CallPeer`` (Opus decode, inbound resampling
to 16 kHz, the paced outbound track) and a client ``ClientPeer`` — exchange audio both ways
(speech in, a tone out) over loopback with no VAD, no session and no model. The process CPU over
the measuring window, halved, is the media cost of one peer: the floor under the server's CPU per
call that ``evaluation/duplex_bench.py`` reports.

``--opus`` measures instead how the outbound audio is encoded (no network): aiortc's own path
(stereo frames, its RFC 6464 audio-level loop, its Opus encoder at complexity 10) against
:class:`~duplex.media.paced_track.OpusPacketTrack` at each libopus complexity — thread CPU per
20 ms frame while speaking and while silent, both driven through the tracks' own ``recv`` on a
virtual clock, and what the listener hears: piper speech encoded, decoded as aiortc decodes it and
transcribed by the offline recogniser (word error rate). That is how ``OPUS_COMPLEXITY`` was chosen.

    python -m evaluation.webrtc_media_cpu [--seconds 20] [--opus [--rounds 3]]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import av
import numpy as np
from aiortc import rtp
from aiortc.codecs.opus import OpusEncoder

from duplex.media.paced_track import FRAME_SECONDS, OpusPacketTrack, OutboundAudioTrack
from duplex.media.pcm import float_to_pcm16
from duplex.transports.webrtc.peer import CallPeer
from evaluation.bench_common import format_table, run_in_loopback_namespace, write_json
from harness.mic import ScriptedMic
from harness.peers import LOOPBACK, ClientPeer, Recorder
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


SENTENCES = (
    "Could you tell me what the weather will be like tomorrow?",
    "The train to the airport leaves at seven fifteen from platform three.",
    "Please remind me to call my sister on Sunday afternoon.",
    "How many kilometres is it from Paris to Berlin by car?",
    "I would like a table for four people at eight o'clock tonight.",
    "Turn off the lights in the kitchen and lock the front door.",
)
COMPLEXITIES = (10, 8, 5, 3, 1, 0)
SILENT_FRAMES = 250  # 5 s of the agent being quiet


class _StepClock:
    """A pacing clock for driving a track's ``recv`` flat out: each reading is half a frame
    later than the one before, and recv reads it twice per frame, so no frame ever waits."""

    def __init__(self) -> None:
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return self.readings * (FRAME_SECONDS / 2)


async def _stock_frames(track: OutboundAudioTrack, frames: int) -> tuple[float, list[bytes]]:
    """aiortc's own sender path: its audio level, then its encoder (on a thread there)."""
    encoder, packets, cpu = OpusEncoder(), [], 0.0
    for _ in range(frames):
        start = time.thread_time()
        frame = await track.recv()
        rtp.compute_audio_level_dbov(frame)
        payloads, _ = encoder.encode(frame)
        cpu += time.thread_time() - start
        packets += payloads
    return cpu, packets


async def _packet_frames(track: OpusPacketTrack, frames: int) -> tuple[float, list[bytes]]:
    packets, cpu = [], 0.0
    for _ in range(frames):
        start = time.thread_time()
        packet = await track.recv()
        cpu += time.thread_time() - start
        packets.append(bytes(packet))
    return cpu, packets


async def _encode(samples: np.ndarray, complexity: int | None) -> tuple[float, float, list[bytes]]:
    """µs per speech frame, µs per silent frame, and the packets of ``samples``; complexity None
    is aiortc's own path."""
    source = OutboundAudioTrack(clock=_StepClock())
    if complexity is None:
        track, run = source, _stock_frames
    else:
        track, run = OpusPacketTrack(source, complexity), _packet_frames
    speech_frames = -(-len(samples) // source.frame_samples)
    source.enqueue("speech", float_to_pcm16(samples))
    speech_cpu, packets = await run(track, speech_frames)  # type: ignore[arg-type]
    silence_cpu, _ = await run(track, SILENT_FRAMES)  # type: ignore[arg-type]
    track.stop()
    return 1e6 * speech_cpu / speech_frames, 1e6 * silence_cpu / SILENT_FRAMES, packets


def _decode(packets: list[bytes]) -> np.ndarray:
    """What the listener gets: libopus decoding to 48 kHz stereo s16, as aiortc and browsers do."""
    decoder = av.CodecContext.create("libopus", "r")
    decoder.format, decoder.layout, decoder.sample_rate = "s16", "stereo", 48000
    out = [f.to_ndarray().reshape(-1, 2)[:, 0] for p in packets for f in decoder.decode(av.Packet(p))]
    return np.concatenate(out).astype(np.float32) / 32768


def _snr_db(source: np.ndarray, decoded: np.ndarray) -> float:
    """Waveform SNR of the decoded speech against the source, at the codec's own delay (found by
    cross-correlation): a coarse check beside the recogniser's, which forgives a lot."""
    n = len(source)
    lags = range(2000)
    lag = max(lags, key=lambda k: float(np.dot(source[: n - 2000], decoded[k : k + n - 2000])))
    heard = decoded[lag : lag + n]
    noise = source[: len(heard)] - heard
    return 10 * float(np.log10(np.sum(source[: len(heard)] ** 2) / max(np.sum(noise**2), 1e-12)))


def opus_choices(rounds: int) -> list[dict[str, object]]:
    from harness.speech import natural_speech
    from harness.wer import wer
    from pipeline.models.offline.asr import Transcriber
    from pipeline.models.offline.sources import asr_model_dir

    recogniser = Transcriber(asr_model_dir("packaged"))
    voices = [natural_speech(text, 48000, 0.3, 0.3) for text in SENTENCES]
    rows: list[dict[str, object]] = [{
        "encoder": "source (no codec)", "speech_us_per_frame": None, "silence_us_per_frame": None,
        "snr_db": None,
        "wer": round(float(np.mean([wer(t, recogniser.transcribe(v, 48000))
                                    for t, v in zip(SENTENCES, voices)])), 3),
    }]
    for complexity in (None, *COMPLEXITIES):
        speaking, silent, errors, snrs = [], [], [], []
        for i, (text, samples) in enumerate(zip(SENTENCES, voices)):
            for _ in range(rounds):
                per_speech, per_silence, packets = asyncio.run(_encode(samples, complexity))
                speaking.append(per_speech)
                silent.append(per_silence)
            heard = _decode(packets)
            errors.append(wer(text, recogniser.transcribe(heard, 48000)))
            snrs.append(_snr_db(float_to_pcm16(samples).astype(np.float32) / 32768, heard))
        rows.append({
            "encoder": "aiortc stereo c10 + level" if complexity is None else f"packets mono c{complexity}",
            "speech_us_per_frame": [round(min(speaking)), round(float(np.median(speaking)))],
            "silence_us_per_frame": [round(min(silent)), round(float(np.median(silent)))],
            "snr_db": round(float(np.median(snrs)), 1),
            "wer": round(float(np.mean(errors)), 3),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--opus", action="store_true", help="compare the outbound encoders instead")
    parser.add_argument("--rounds", type=int, default=3, help="--opus: CPU repeats per sentence")
    args = parser.parse_args()
    if args.opus:
        rows = opus_choices(args.rounds)
        print(format_table(
            ["encoder", "speech µs/frame (min, median)", "silence µs/frame", "SNR dB", "WER"],
            [[r["encoder"], r["speech_us_per_frame"], r["silence_us_per_frame"], r["snr_db"],
              r["wer"]] for r in rows]))
        print(f"wrote {write_json('webrtc_opus_choices', rows)}")
        return
    run_in_loopback_namespace("evaluation.webrtc_media_cpu")
    result = asyncio.run(measure(args.seconds))
    print(f"one call's media, both peers in one process: {result['both_peers_percent_of_a_core']}% "
          f"of a core; per peer {result['per_peer_percent_of_a_core']}% "
          f"({result['inbound_audio_s']} s of audio received in {result['window_s']} s)")
    print(f"wrote {write_json('webrtc_media_cpu', result)}")


if __name__ == "__main__":
    main()
