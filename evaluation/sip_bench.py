"""``python -m evaluation.sip_bench [--calls N]``: phone calls over SIP on loopback, timed.

A caller written here (SIP over UDP, μ-law RTP both ways, a phone's continuous 20 ms packets)
calls ``duplex.serve --sip-port`` on the ``toy`` preset, so that framework costs show. Each call
asks a question (espeak-ng), and talks over the answer 1.2 s into it. Measured at the caller, on
its own clock: end of the question → first voiced agent packet; onset of the interruption → last
voiced agent packet; and the server's CPU per call (main process and stage processes). Prints a
table and writes ``evaluation/results/sip_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from duplex.media.pcm import float_to_pcm16, ulaw_decode, ulaw_encode
from duplex.transports.sip.message import parse
from duplex.transports.sip.sdp import parse_offer
from evaluation.bench_common import (
    format_table,
    machine,
    run_in_loopback_namespace,
    save_figure,
    save_results,
    summarize,
)
from evaluation.proc_cpu import CpuSample
from harness.calls import INTERRUPTION, QUESTION
from harness.server import free_port, run_server, write_preset
from harness.speech import speech

RATE, FRAME = 8000, 160
VOICED = 500  # 16-bit RMS of a packet that carries the agent's voice (the toy's tone: ~7000)
TIMEOUT = 30.0


class Udp(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[bytes, float]] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.queue.put_nowait((data, asyncio.get_running_loop().time()))

    @property
    def port(self) -> int:
        assert self.transport is not None
        return self.transport.get_extra_info("sockname")[1]


async def udp() -> Udp:
    _, peer = await asyncio.get_running_loop().create_datagram_endpoint(Udp, local_addr=("127.0.0.1", 0))
    return peer


def request(method: str, sip: Udp, server: int, call_id: str, cseq: int, to_tag: str = "",
            body: str = "") -> bytes:
    to = "<sip:agent@127.0.0.1>" + (f";tag={to_tag}" if to_tag else "")
    lines = [f"{method} sip:agent@127.0.0.1:{server} SIP/2.0",
             f"Via: SIP/2.0/UDP 127.0.0.1:{sip.port};branch=z9hG4bK{secrets.token_hex(6)}",
             "Max-Forwards: 70", "From: <sip:bench@127.0.0.1>;tag=bench", f"To: {to}",
             f"Call-ID: {call_id}", f"CSeq: {cseq} {method}", f"Contact: <sip:bench@127.0.0.1:{sip.port}>"]
    if body:
        lines.append("Content-Type: application/sdp")
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n" + body).encode()


def rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2)))


async def one_call(server_port: int) -> dict[str, float]:
    sip, rtp = await udp(), await udp()
    assert sip.transport is not None and rtp.transport is not None
    call_id = secrets.token_hex(8)
    offer = "\r\n".join(["v=0", "o=bench 1 1 IN IP4 127.0.0.1", "s=-", "c=IN IP4 127.0.0.1", "t=0 0",
                         f"m=audio {rtp.port} RTP/AVP 0", "a=rtpmap:0 PCMU/8000", ""])
    sip.transport.sendto(request("INVITE", sip, server_port, call_id, 1, body=offer), ("127.0.0.1", server_port))
    while (answer := parse((await asyncio.wait_for(sip.queue.get(), TIMEOUT))[0])).status < 200:
        pass
    assert answer.status == 200, answer.status
    (audio,) = [m for m in parse_offer(answer.body.decode()) if m.kind == "audio"]
    agent = ("127.0.0.1", audio.port)
    to_tag = answer.to_tag or ""
    sip.transport.sendto(request("ACK", sip, server_port, call_id, 1, to_tag), ("127.0.0.1", server_port))
    question = float_to_pcm16(speech(QUESTION, RATE, 0.3, 0.0))
    interruption = float_to_pcm16(speech(INTERRUPTION, RATE, 0.0, 0.0))
    loop = asyncio.get_running_loop()
    sent: list[tuple[float, float]] = []  # (time, rms) of each packet the caller sent
    heard: list[tuple[float, float]] = []  # (time, rms) of each packet of the agent's
    queue = [question]
    state = {"interrupting": False, "interrupted_at": None}

    async def receive() -> None:
        while True:
            data, at = await rtp.queue.get()
            if len(data) > 12 and data[1] & 0x7F == 0:
                heard.append((at, rms(ulaw_decode(data[12:]))))

    receiver = asyncio.create_task(receive())
    seq, stamp, next_at = 1, 0, loop.time()
    pending = np.concatenate(queue)
    while True:
        voiced = [t for t, r in heard if r > VOICED]
        if not state["interrupting"] and voiced and voiced[-1] - voiced[0] >= 1.2:
            state["interrupting"] = True
            pending = interruption
        frame, pending = pending[:FRAME], pending[FRAME:]
        frame = np.pad(frame, (0, FRAME - len(frame)))
        header = struct.pack("!BBHII", 0x80, 0, seq & 0xFFFF, stamp & 0xFFFFFFFF, 0xBE7C)
        rtp.transport.sendto(header + ulaw_encode(frame), agent)
        sent.append((loop.time(), rms(frame)))
        seq, stamp, next_at = seq + 1, stamp + FRAME, next_at + FRAME / RATE
        if state["interrupting"] and not len(pending) and loop.time() > sent[-1][0]:
            break
        await asyncio.sleep(max(0.0, next_at - loop.time()))
    receiver.cancel()
    sip.transport.sendto(request("BYE", sip, server_port, call_id, 2, to_tag), ("127.0.0.1", server_port))
    sip.transport.close()
    rtp.transport.close()
    question_end = max(t for t, r in sent[: len(question) // FRAME] if r > VOICED)
    first_voice = min(t for t, r in heard if r > VOICED and t > question_end)
    onset = min(t for t, r in sent[len(question) // FRAME :] if r > VOICED)
    last_voice = max(t for t, r in heard if r > VOICED and t < sent[-1][0])
    return {"turn_to_first_packet_s": first_voice - question_end, "onset_to_silence_s": last_voice - onset}


async def bench(calls: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        preset = write_preset(Path(tmp) / "preset.yaml")
        with run_server(preset, "--sip-port", str(port), tmp=Path(tmp)) as server:
            results = []
            for _ in range(calls):
                before = CpuSample.take(server.process.pid)
                timing = await one_call(port)
                results.append({**timing, **CpuSample.usage(before, CpuSample.take(server.process.pid))})
    return {
        "machine": machine(),
        "calls": results,
        "turn_to_first_packet_ms": summarize(r["turn_to_first_packet_s"] for r in results),
        "onset_to_silence_ms": summarize(r["onset_to_silence_s"] for r in results),
        "server_main_cores": summarize((r["server_main_cores"] for r in results), 100),
        "stage_process_cores": summarize((r["stage_process_cores"] for r in results), 100),
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    calls = results["calls"]
    ax.plot([c["turn_to_first_packet_s"] * 1000 for c in calls], "o-", label="end of turn → first agent packet")
    ax.plot([c["onset_to_silence_s"] * 1000 for c in calls], "s-", label="barge-in onset → last agent packet")
    ax.set_xlabel("call")
    ax.set_ylabel("ms")
    ax.set_title("SIP on loopback, toy preset")
    ax.legend()
    save_figure(fig, path, dpi=100)


def main() -> None:
    run_in_loopback_namespace("evaluation.sip_bench")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=5)
    results = asyncio.run(bench(parser.parse_args().calls))
    rows = [[name, results[name]["p50"], results[name]["p99"], results[name]["max"]]
            for name in ("turn_to_first_packet_ms", "onset_to_silence_ms")]
    rows += [[f"{name} (% of a core)", results[name]["p50"], results[name]["p99"], results[name]["max"]]
             for name in ("server_main_cores", "stage_process_cores")]
    print(format_table(["measure", "p50", "p99", "max"], rows))
    print(f"machine: {results['machine']}")
    save_results("sip_bench", results, plot)


if __name__ == "__main__":
    main()
