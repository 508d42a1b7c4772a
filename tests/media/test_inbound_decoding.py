"""Inbound audio decoded on the event loop (duplex/transports/webrtc/inbound.py): the same frames
aiortc's decoder thread gives, the swap applied to a real call's receiver, and the track still
ending (and aiortc's thread with it) when the call closes. Real peers: run in a loopback-only
netns."""

from __future__ import annotations

import asyncio
import fractions
import queue
import threading

import aiortc
import av
import numpy as np
from aiortc.codecs import get_capabilities
from aiortc.codecs.opus import OpusEncoder
from aiortc.jitterbuffer import JitterFrame
from aiortc.rtcrtpreceiver import decoder_worker

from duplex.transports.webrtc.inbound import _DECODER_QUEUE, TESTED_AIORTC, LoopDecoder
from duplex.transports.webrtc.peer import CallPeer
from harness.mic import ScriptedMic
from harness.peers import LOOPBACK, ClientPeer, Recorder
from harness.speech import speech

QUESTION = "Could you tell me what the weather will be like tomorrow?"
OPUS = next(c for c in get_capabilities("audio").codecs if c.mimeType == "audio/opus")


def opus_frames(samples: np.ndarray) -> list[JitterFrame]:
    """48 kHz mono float32 speech as aiortc's sender encodes it, one JitterFrame per packet."""
    encoder, frames = OpusEncoder(), []
    pcm = (samples * 32767).astype(np.int16)
    for i in range(len(pcm) // 960):
        frame = av.AudioFrame.from_ndarray(pcm[i * 960 : (i + 1) * 960].reshape(1, -1),
                                           format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 48000, i * 960, fractions.Fraction(1, 48000)
        packets, _ = encoder.encode(frame)
        frames += [JitterFrame(data=p, timestamp=i * 960) for p in packets]
    return frames


async def drain(frames: asyncio.Queue[av.AudioFrame | None]) -> list[av.AudioFrame]:
    got = []
    while (frame := await frames.get()) is not None:
        got.append(frame)
    return got


async def test_loop_decoding_gives_the_frames_of_aiortcs_decoder_thread() -> None:
    encoded = opus_frames(speech(QUESTION, 48000, 0.2, 0.2))
    loop = asyncio.get_running_loop()
    # aiortc's own path: its worker thread, fed through a queue.Queue.
    threaded: asyncio.Queue[av.AudioFrame | None] = asyncio.Queue()
    tasks: queue.Queue = queue.Queue()
    worker = threading.Thread(target=decoder_worker, args=(loop, tasks, threaded, threading.Event()))
    worker.start()
    for frame in encoded:
        tasks.put((OPUS, frame))
    tasks.put(None)
    expected = await drain(threaded)
    await asyncio.to_thread(worker.join)
    # The loop decoder, stopped the same way, with aiortc's thread blocked on it meanwhile.
    inline: asyncio.Queue[av.AudioFrame | None] = asyncio.Queue()
    decoder = LoopDecoder(inline)
    waiting = threading.Thread(target=decoder_worker, args=(loop, decoder, inline, threading.Event()))
    waiting.start()
    for frame in encoded:
        decoder.put((OPUS, frame))
    assert waiting.is_alive() and inline.qsize() == len(expected)  # decoded at once, on the loop
    decoder.put(None)
    got = await drain(inline)
    await asyncio.to_thread(waiting.join)
    assert len(got) == len(expected) == len(encoded)
    for a, b in zip(got, expected):
        assert (a.pts, a.sample_rate, a.layout.name, a.format.name) == (
            b.pts, b.sample_rate, b.layout.name, b.format.name)
        assert np.array_equal(a.to_ndarray(), b.to_ndarray())
    assert max(np.abs(f.to_ndarray()).max() for f in got) > 3000  # speech, not silence


async def test_a_calls_receiver_decodes_on_the_loop_and_ends_with_the_call() -> None:
    # The swap reaches into aiortc's privates: a new aiortc must be checked before it is used.
    assert aiortc.__version__ == TESTED_AIORTC
    listener = Recorder()
    server = CallPeer("inbound-1", LOOPBACK, listener)
    mic = ScriptedMic()
    client = ClientPeer(mic)
    try:
        await client.connect(server)
        (receiver,) = server._pc.getReceivers()
        assert isinstance(getattr(receiver, _DECODER_QUEUE), LoopDecoder)
        await mic.say(speech(QUESTION, 48000, 0.0, 0.0))
        heard = np.concatenate([samples for samples, _ in listener.audio])
        assert np.sqrt(np.mean(heard**2)) > 0.01  # the speech came through, at 16 kHz mono
        assert heard.dtype == np.float32 and heard.ndim == 1
    finally:
        await client.close()
        await server.close()
    assert listener.closed == ["closed"]
    # aiortc's decoder thread, blocked on the swapped queue, ended with the receiver.
    assert not [t for t in threading.enumerate() if t.name == "audio-decoder"]
    assert receiver.track.readyState == "ended"
