"""Phone calls to the agent: a real ``duplex.serve`` with ``--sip-port`` (toy model, paced like a
real one) called by a real sipp playing speech made at test time. The test's own UDP socket is the
caller's RTP address in the offer, so it sees every packet the agent sends."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from duplex.media.pcm import alaw_decode, ulaw_decode, ulaw_encode
from duplex.transports.sip.rtp import RtpPacket
from harness.calls import INTERRUPTION, wait_stages_idle
from harness.server import ServerProcess, free_port, run_server, write_preset

from .peers import UdpPeer, rms, sipp, telephone_event

pytestmark = pytest.mark.e2e

QUESTION = "What is the weather like tomorrow?"
DECODERS = {0: ulaw_decode, 8: alaw_decode}
VOICED = 500  # packet RMS (16-bit) above which the agent is speaking; the toy's tone is ~7000


@pytest.fixture(scope="module")
def speech_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sip-agent")
    for name, text in (("question", QUESTION), ("interruption", INTERRUPTION)):
        wav = folder / f"{name}.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(wav), text], check=True)
        for kind in ("ul", "al"):
            out = folder / f"{name}.{'ulaw' if kind == 'ul' else 'alaw'}"
            subprocess.run(["sox", str(wav), "-r", "8000", "-c", "1", "-t", kind, str(out)], check=True)
    return folder


@pytest.fixture(scope="module")
def sip_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, sip_port: int) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("sip-server")
    preset = write_preset(tmp / "preset.yaml", stages={
        "thinker": {"options": {"step_delay_s": 0.2}}, "talker": {"options": {"step_delay_s": 0.05}}})
    with run_server(preset, "--sip-port", str(sip_port), "--rtp-ports", "43000-43099", tmp=tmp) as running:
        yield running


def voiced_runs(sink: UdpPeer) -> tuple[list[tuple[float, float]], list[RtpPacket]]:
    """The agent's packets, and the stretches (start, end) in which it was speaking."""
    packets = [(RtpPacket.parse(data), at) for data, at in sink.drain()]
    packets = [(p, at) for p, at in packets if p is not None and p.payload_type in DECODERS]
    runs: list[tuple[float, float]] = []
    for packet, at in packets:
        if rms(DECODERS[packet.payload_type](packet.payload)) < VOICED:
            continue
        if runs and at - runs[-1][1] < 0.2:
            runs[-1] = (runs[-1][0], at)
        else:
            runs.append((at, at))
    return runs, [p for p, _ in packets]


async def test_a_caller_is_answered_and_can_interrupt(server: ServerProcess, sip_port: int,
                                                      speech_dir: Path) -> None:
    barge_ins = server.metric("duplex_barge_ins_total")
    sink = await UdpPeer.open()
    try:
        rc, out = await sipp("agent_barge_in.xml", sip_port, speech_dir, ("rtp_sink", str(sink.port)))
        assert rc == 0, out
        runs, packets = voiced_runs(sink)
    finally:
        sink.close()
    assert {p.payload_type for p in packets} == {0}
    # The answer started, was cut short by the caller (the whole answer is 2.9 s), the agent was
    # quiet while the caller spoke, and answered the interruption afterwards.
    assert len(runs) >= 2, runs
    first, second = runs[0], runs[1]
    assert 0.5 < first[1] - first[0] < 2.5, runs
    assert second[0] - first[1] > 1.0, runs
    assert server.metric("duplex_barge_ins_total") == barge_ins + 1
    assert server.metric("duplex_sessions_total", {"transport": "sip"}) >= 1
    await wait_sip_sessions_gone(server)
    await wait_stages_idle(server)


async def test_a_pcma_caller_with_dtmf(server: ServerProcess, sip_port: int, speech_dir: Path) -> None:
    sink = await UdpPeer.open()
    caller = asyncio.create_task(
        sipp("agent_pcma.xml", sip_port, speech_dir, ("rtp_sink", str(sink.port))))
    try:
        # The agent's RTP comes from its RTP port: where the keypad's events go.
        _, _, agent_rtp = await asyncio.wait_for(sink.queue.get(), 15)
        seq, stamp = 2000, 9000
        for duration, end in ((160, False), (320, False), (640, True), (640, True), (640, True)):
            packet = RtpPacket(101, seq, stamp, 0x4321, telephone_event(5, end, duration),
                               marker=duration == 160)
            sink.send(packet.serialise(), agent_rtp)
            seq += 1
        rc, out = await asyncio.wait_for(caller, 30)
        assert rc == 0, out
        runs, packets = voiced_runs(sink)
    finally:
        caller.cancel()
        sink.close()
    assert {p.payload_type for p in packets} == {8}
    assert runs and max(end - start for start, end in runs) > 2.0, runs  # the whole answer
    assert server.log().count("the caller pressed 5") == 1
    await wait_sip_sessions_gone(server)
    await wait_stages_idle(server)


async def wait_sip_sessions_gone(server: ServerProcess) -> None:
    deadline = asyncio.get_running_loop().time() + 15
    while server.metric("duplex_sessions_active", {"transport": "sip"}) > 0:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.1)  # the gauge lives in another process: polled


def test_voiced_runs_join_packets_and_split_pauses() -> None:
    """The analysis the two calls rely on, on packets whose content is known."""
    sink = UdpPeer()
    tone = (7000 * np.sin(np.arange(160) / 3)).astype(np.int16)
    for i, voiced in enumerate([1] * 10 + [0] * 20 + [1] * 5):
        payload = ulaw_encode(tone if voiced else np.zeros(160, np.int16))
        sink.queue.put_nowait((RtpPacket(0, i, i * 160, 1, payload).serialise(), i * 0.02, ("", 0)))
    runs, packets = voiced_runs(sink)
    assert len(packets) == 35 and len(runs) == 2
    assert runs[0] == (0.0, 0.18) and runs[1][0] == pytest.approx(0.6)
