"""``python -m evaluation.dial_bench [--calls N]``: calls the server places over SIP, timed.

``duplex.serve --sip-port`` on the ``toy`` preset places each call (``POST /v1/realtime/calls``
with a ``target_uri``) to a callee written here on loopback, which answers every INVITE at once
with 200 OK (no ringing) and takes the server's RTP. Measured on the callee's clock, per call:

- POST → INVITE: the API request, the checks and the dial (RTP ports, the offer) until the INVITE
  is on the wire;
- INVITE → 200 OK as the server sees it: our 200 leaves at once, so this is 200 OK → the server's
  ACK (its response handling, the session's admission and start) plus one loopback hop each way;
- 200 OK → first RTP packet from the server: the call's media running;
- POST → 201: the API's answer.

Then ``/hangup`` and the BYE. Prints a table and writes ``evaluation/results/dial_bench.json`` and
``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from duplex.transports.sip.message import SipMessage, parse
from duplex.transports.sip.transaction import response
from evaluation.bench_common import (
    format_table,
    machine,
    run_in_loopback_namespace,
    save_figure,
    save_results,
    summarize,
)
from harness.server import free_port, run_server, write_preset

TIMEOUT = 10.0
MEASURES = ("post_to_invite_ms", "invite_to_ack_ms", "ok_to_first_rtp_ms", "post_to_201_ms")


class Udp(asyncio.DatagramProtocol):
    """A loopback socket that queues what it receives, with the monotonic time it came."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[bytes, float, Any]] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.queue.put_nowait((data, time.monotonic(), addr))

    @property
    def port(self) -> int:
        assert self.transport is not None
        return self.transport.get_extra_info("sockname")[1]

    async def request(self, method: str) -> tuple[SipMessage, float, Any]:
        """The next SIP request ``method`` received (anything else skipped)."""
        async with asyncio.timeout(TIMEOUT):
            while True:
                data, at, addr = await self.queue.get()
                msg = parse(data)
                if msg.method == method:
                    return msg, at, addr


async def open_udp() -> Udp:
    _, peer = await asyncio.get_running_loop().create_datagram_endpoint(
        Udp, local_addr=("127.0.0.1", 0))
    return peer


def answer_sdp(port: int) -> bytes:
    return ("v=0\r\no=callee 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
            f"m=audio {port} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n").encode()


async def one_call(http: httpx.AsyncClient, sip: Udp, rtp: Udp) -> dict[str, float]:
    async def place() -> tuple[httpx.Response, float]:
        answer = await http.post("/v1/realtime/calls", json={
            "target_uri": f"sip:callee@127.0.0.1:{sip.port}"})
        return answer, time.monotonic()

    posted = time.monotonic()
    placing = asyncio.create_task(place())
    invite, invited, addr = await sip.request("INVITE")
    ok = response(invite, 200, addr, to_tag=secrets.token_hex(4), body=answer_sdp(rtp.port),
                  headers=[("contact", f"<sip:callee@127.0.0.1:{sip.port}>")])
    assert sip.transport is not None and rtp.transport is not None
    answered = time.monotonic()
    sip.transport.sendto(ok.serialise(), addr)
    _, acked, _ = await sip.request("ACK")
    _, first_rtp, _ = await asyncio.wait_for(rtp.queue.get(), TIMEOUT)
    placed, created = await placing
    assert placed.status_code == 201, placed.text
    hangup = await http.post(f"/v1/realtime/calls/{placed.json()['id']}/hangup")
    assert hangup.status_code == 200, hangup.text
    bye, _, addr = await sip.request("BYE")
    sip.transport.sendto(response(bye, 200, addr).serialise(), addr)
    while not rtp.queue.empty():
        rtp.queue.get_nowait()
    return {"post_to_invite_ms": (invited - posted) * 1000, "invite_to_ack_ms": (acked - invited) * 1000,
            "ok_to_first_rtp_ms": (first_rtp - answered) * 1000, "post_to_201_ms": (created - posted) * 1000}


async def bench(calls: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        preset = write_preset(tmp / "preset.yaml", pipeline_mode="inproc", sip_port=free_port(),
                              rtp_ports="44000-44099")
        with run_server(preset, tmp=tmp) as server:
            sip, rtp = await open_udp(), await open_udp()
            async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
                await one_call(http, sip, rtp)  # warm-up: imports, first allocations
                results = [await one_call(http, sip, rtp) for _ in range(calls)]
    return {"calls": results, "machine": machine(),
            **{name: summarize((r[name] for r in results), 1.0) for name in MEASURES}}


def plot_calls(results: dict[str, Any], path: Path, measures: tuple[str, ...], title: str) -> None:
    """Each of ``measures`` (ms) call by call: the SIP benchmarks' plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in measures:
        ax.plot([c[name] for c in results["calls"]], "o-", label=name.removesuffix("_ms").replace("_", " "))
    ax.set_xlabel("call")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend()
    save_figure(fig, path, dpi=100)


def plot(results: dict[str, Any], path: Path) -> None:
    plot_calls(results, path, MEASURES, "Calls placed over SIP on loopback, toy preset")


def main() -> None:
    run_in_loopback_namespace("evaluation.dial_bench")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20)
    results = asyncio.run(bench(parser.parse_args().calls))
    rows = [[name, results[name]["p50"], results[name]["p99"], results[name]["max"]] for name in MEASURES]
    print(format_table(["measure", "p50", "p99", "max"], rows))
    print(f"machine: {results['machine']}")
    save_results("dial_bench", results, plot)


if __name__ == "__main__":
    main()
