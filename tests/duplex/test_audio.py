"""Resampling and G.711: rates, lengths, frame sizes, gain, and sox as the G.711 reference."""

from __future__ import annotations

import subprocess

import av
import numpy as np
import pytest

from duplex.media import pcm, resample
from harness.speech import speech


def tone(rate: int, seconds: float, hz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum) * rate / len(samples))


def decoded_frames(samples: np.ndarray, rate: int) -> list[av.AudioFrame]:
    """s16 frames of 20 ms with pts, as aiortc's decoders hand them out (mono 1-D, stereo 2-D)."""
    step, layout = rate // 50, "mono" if samples.ndim == 1 else "stereo"
    frames = []
    for start in range(0, len(samples), step):
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(samples[start : start + step]).reshape(1, -1),
            format="s16", layout=layout,
        )
        frame.sample_rate, frame.pts = rate, start
        frames.append(frame)
    return frames


def test_opus_frames_become_16k_mono_float_at_unity_gain() -> None:
    mono = pcm.float_to_pcm16(tone(48000, 1.0, amplitude=0.5))
    resampler = resample.FrameResampler(16000)
    chunks = [resampler.push(f) for f in decoded_frames(np.stack([mono, mono], axis=1), 48000)]
    out = np.concatenate(chunks)

    assert out.dtype == np.float32 and out.ndim == 1
    # After the filter's initial delay (a few samples) every 20 ms frame yields 20 ms at 16 kHz.
    assert all(len(c) == 320 for c in chunks[1:])
    assert 16000 - 32 < len(out) <= 16000
    assert abs(dominant_hz(out, 16000) - 440) < 2
    # Identical channels average to the source level (libswresample alone would add 3 dB).
    assert np.max(np.abs(out)) == pytest.approx(0.5, abs=0.01)


def test_frame_resampler_follows_the_negotiated_codec_rate() -> None:
    resampler = resample.FrameResampler(16000)
    for rate in (8000, 48000, 16000):  # G.711, Opus (mono here), G.722
        samples = pcm.float_to_pcm16(tone(rate, 0.5, hz=300))
        out = np.concatenate([resampler.push(f) for f in decoded_frames(samples, rate)])
        assert 8000 - 64 < len(out) <= 8000  # minus the filter delay
        assert abs(dominant_hz(out, 16000) - 300) < 4


def test_stereo_downmix_averages_channels() -> None:
    left = pcm.float_to_pcm16(tone(48000, 0.5, amplitude=0.8))
    resampler = resample.Resampler(48000, 16000, in_dtype=np.int16, in_channels=2)
    out = np.concatenate([resampler.push(np.stack([left, np.zeros_like(left)], axis=1)),
                          resampler.flush()])
    assert np.max(np.abs(out)) == pytest.approx(0.4, abs=0.01)


def test_decoded_frames_downmix_at_unity_gain_without_clipping() -> None:
    # One channel silent: the average is half; both at full scale: full scale, not past it
    # (libswresample's own remix sums at -3 dB, +3 dB over the source for identical channels).
    loud = pcm.float_to_pcm16(tone(48000, 0.5, amplitude=0.99))
    for right, peak in ((np.zeros_like(loud), 0.495), (loud, 0.99)):
        resampler = resample.FrameResampler(16000)
        frames = decoded_frames(np.stack([loud, right], axis=1), 48000)
        out = np.concatenate([resampler.push(f) for f in frames])
        assert np.max(np.abs(out)) == pytest.approx(peak, abs=0.01)


def test_model_output_to_48k_and_back_round_trips() -> None:
    source = speech("Round trip through the resampler.", 24000)
    up = resample.Resampler(24000, 48000, out_dtype=np.int16)
    # Arbitrary chunk sizes, as code2wav streams them.
    pieces = np.array_split(source, [1000, 1001, 5000, 12345, 30000])
    at48 = np.concatenate([up.push(p) for p in pieces] + [up.flush()])
    assert at48.dtype == np.int16 and len(at48) == 2 * len(source)

    down = resample.Resampler(48000, 24000, in_dtype=np.int16)
    back = np.concatenate([down.push(at48), down.flush()])
    assert len(back) == len(source)
    # The two filters delay the signal by a few samples; line it up before comparing.
    lag = int(np.argmax(np.correlate(back[:4800], source[:4800], mode="full"))) - 4799
    aligned = back[lag:] if lag >= 0 else back[: len(back) + lag]
    reference = source[: len(aligned)] if lag >= 0 else source[-lag:]
    assert abs(lag) < 8
    assert np.corrcoef(aligned, reference)[0, 1] > 0.999


def test_flush_rearms_for_the_next_utterance() -> None:
    resampler = resample.Resampler(24000, 48000, out_dtype=np.int16)
    for seconds in (0.31, 0.5):
        chunk = tone(24000, seconds)
        out = np.concatenate([resampler.push(chunk), resampler.flush()])
        assert len(out) == 2 * len(chunk)


def test_frame_size_gives_whole_frames() -> None:
    # 8 kHz 20 ms frames as RTP G.711 wants them, from 16 kHz model-rate audio.
    resampler = resample.Resampler(16000, 8000, out_dtype=np.int16, frame_size=160)
    lengths = [len(resampler.push(chunk)) for chunk in np.array_split(tone(16000, 1.0), 7)]
    tail = resampler.flush()
    assert all(n % 160 == 0 for n in lengths)
    assert sum(lengths) + len(tail) == 8000 and sum(lengths) > 0


def test_mono_to_stereo_copies_the_channel() -> None:
    resampler = resample.Resampler(24000, 48000, out_dtype=np.int16, out_channels=2)
    out = np.concatenate([resampler.push(tone(24000, 0.2)), resampler.flush()])
    assert out.shape == (9600, 2)
    assert np.array_equal(out[:, 0], out[:, 1])
    assert np.max(np.abs(out)) == pytest.approx(0.5 * 32768, rel=0.01)


def test_pcm16_float_conversion_clips_and_round_trips() -> None:
    clipped = pcm.float_to_pcm16(np.array([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0], dtype=np.float32))
    assert clipped.tolist() == [-32768, -32768, 0, 16384, 32767, 32767]
    everything = np.arange(-32768, 32768, dtype=np.int16)
    assert np.array_equal(pcm.float_to_pcm16(pcm.pcm16_to_float(everything)), everything)


def sox_convert(data: bytes, from_args: list[str], to_args: list[str]) -> bytes:
    # -D: no dither, sox would otherwise add noise when it narrows the samples.
    command = ["sox", "-D", "-t", "raw", "-r", "8000", "-c", "1", *from_args, "-",
               "-t", "raw", *to_args, "-"]
    return subprocess.run(command, input=data, capture_output=True, check=True).stdout


PCM16 = ["-e", "signed-integer", "-b", "16"]


@pytest.mark.parametrize(("encoding", "encode"), [("u-law", pcm.ulaw_encode),
                                                  ("a-law", pcm.alaw_encode)])
def test_g711_encoding_equals_sox_for_every_16_bit_value(encoding: str, encode) -> None:
    everything = np.arange(-32768, 32768, dtype=np.int16)
    assert encode(everything) == sox_convert(everything.tobytes(), PCM16, ["-e", encoding])


@pytest.mark.parametrize(("encoding", "decode"), [("u-law", pcm.ulaw_decode),
                                                  ("a-law", pcm.alaw_decode)])
def test_g711_decoding_equals_sox_for_every_code(encoding: str, decode) -> None:
    codes = bytes(range(256))
    expected = np.frombuffer(sox_convert(codes, ["-e", encoding], PCM16), dtype=np.int16)
    assert np.array_equal(decode(codes), expected)


def test_g711_reference_points_and_speech_round_trip() -> None:
    # ITU-T G.711: zero is 0xFF in μ-law, 0xD5 in A-law; full scale decodes to ±32124 / ±32256.
    assert pcm.ulaw_encode(np.array([0], dtype=np.int16)) == b"\xff"
    assert pcm.alaw_encode(np.array([0], dtype=np.int16)) == b"\xd5"
    assert pcm.ulaw_decode(b"\x00\x80").tolist() == [-32124, 32124]
    assert pcm.alaw_decode(b"\x2a\xaa").tolist() == [-32256, 32256]

    voice = pcm.float_to_pcm16(speech("Telephone quality speech.", 8000))
    for encode, decode in ((pcm.ulaw_encode, pcm.ulaw_decode),
                           (pcm.alaw_encode, pcm.alaw_decode)):
        decoded = decode(encode(voice))
        assert len(decoded) == len(voice)
        # 8-bit companding keeps speech well above 30 dB SNR.
        noise = np.sum((decoded.astype(np.float64) - voice) ** 2)
        assert 10 * np.log10(np.sum(voice.astype(np.float64) ** 2) / noise) > 30
