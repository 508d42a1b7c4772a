"""``python -m evaluation.webhook_bench [--calls N]``: incoming SIP calls that the app answers
through the call webhook, timed.

``duplex.serve --sip-port --call-webhook`` on the ``toy`` preset; the webhook is a receiver written
here on loopback that answers each ``realtime.call.incoming`` POST with 200 at once and then accepts
the call (``POST /v1/realtime/calls/{id}/accept`` with ``{}``), as an app that decides at once
does. The caller is a raw UDP user agent client, also here, which sends the INVITE (with a PCMU
offer), takes 100/180/200, ACKs, then hangs up with a BYE. Everything runs in this process's
event loop against the server's process, so all times are on one clock. Per call:

- INVITE → webhook: the INVITE leaves the caller until the receiver has the POST (the server's
  checks, 100 and 180, the event, its signature, the HTTP request);
- /accept → 200 OK: the receiver sends ``/accept`` until the caller has the 200 OK with the SDP
  answer (the session config checked, the session admitted and started, the answer built);
- the /accept request itself: until its 200 reaches the receiver (the server answers it once
  the session is live; the caller's 200 OK leaves at the same moment);
- INVITE → 200 OK: what the caller sees in all (with an app that decides at once).

Prints p50/p90/max and writes ``evaluation/results/webhook_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from aiohttp import web

from duplex.transports.sip.message import SipMessage, parse
from evaluation.bench_common import (
    format_table,
    machine,
    run_in_loopback_namespace,
    save_results,
    summarize,
)
from evaluation.dial_bench import TIMEOUT, Udp, open_udp, plot_calls
from harness.server import free_port, run_server, write_preset

MEASURES = ("invite_to_webhook_ms", "accept_to_ok_ms", "accept_request_ms", "invite_to_ok_ms")
SECRET = "bench-secret"  # the server signs with it; this app does not verify (not measured)


class App:
    """The operator's app: takes each webhook POST (answered 200 at once), then accepts the call
    through the API, keeping when each happened by call id."""

    def __init__(self, api: httpx.AsyncClient) -> None:
        self._api = api
        self.times: dict[str, dict[str, float]] = {}
        self.arrived: asyncio.Queue[str] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()

    async def webhook(self, request: web.Request) -> web.Response:
        received = time.monotonic()
        event = json.loads(await request.read())
        call_id = event["data"]["call_id"]
        self.times[call_id] = {"webhook": received}
        task = asyncio.get_running_loop().create_task(self._accept(call_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return web.Response(status=200)

    async def _accept(self, call_id: str) -> None:
        times = self.times[call_id]
        times["accept_sent"] = time.monotonic()
        answer = await self._api.post(f"/v1/realtime/calls/{call_id}/accept", json={})
        times["accept_done"] = time.monotonic()
        assert answer.status_code == 200, answer.text
        self.arrived.put_nowait(call_id)


async def serve_webhook(app: App) -> tuple[web.AppRunner, int]:
    server = web.Application()
    server.router.add_post("/calls", app.webhook)
    runner = web.AppRunner(server, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def invite(sip: Udp, rtp_port: int, server_port: int, number: int) -> SipMessage:
    """A caller's INVITE with a PCMU offer (RTP at ``rtp_port``)."""
    sdp = ("v=0\r\no=caller 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
           f"m=audio {rtp_port} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n").encode()
    me = f"127.0.0.1:{sip.port}"
    return SipMessage(method="INVITE", uri=f"sip:agent@127.0.0.1:{server_port}", body=sdp, headers=[
        ("via", f"SIP/2.0/UDP {me};rport;branch=z9hG4bK{secrets.token_hex(8)}"),
        ("max-forwards", "70"),
        ("from", f"<sip:caller@{me}>;tag={secrets.token_hex(4)}"),
        ("to", f"<sip:agent@127.0.0.1:{server_port}>"),
        ("call-id", f"bench-{number}-{secrets.token_hex(6)}"),
        ("cseq", "1 INVITE"),
        ("contact", f"<sip:caller@{me}>"),
        ("content-type", "application/sdp")])


def in_dialog(request: SipMessage, ok: SipMessage, method: str, cseq: int) -> SipMessage:
    """The caller's ``method`` (ACK, BYE) in the dialog the INVITE's 200 OK made: each a new
    transaction (the ACK of a 2xx too, RFC 3261 §13.2.2.4), to the 200's Contact."""
    via = (request.get("via") or "").rsplit("branch=", 1)[0] + f"branch=z9hG4bK{secrets.token_hex(8)}"
    target = (ok.get("contact") or request.uri).strip("<>")
    return SipMessage(method=method, uri=target, headers=[
        ("via", via), ("max-forwards", "70"), ("from", request.get("from") or ""),
        ("to", ok.get("to") or ""), ("call-id", request.call_id), ("cseq", f"{cseq} {method}")])


async def response_to(sip: Udp, request: SipMessage, status: int) -> tuple[SipMessage, float]:
    """The next response ``status`` to ``request`` (others, and retransmissions, skipped)."""
    async with asyncio.timeout(TIMEOUT):
        while True:
            data, at, _ = await sip.queue.get()
            msg = parse(data)
            if msg.status == status and msg.call_id == request.call_id \
                    and msg.cseq[1] == request.method:
                return msg, at


async def one_call(app: App, sip: Udp, rtp: Udp, server: tuple[str, int], number: int) -> dict[str, float]:
    assert sip.transport is not None
    request = invite(sip, rtp.port, server[1], number)
    invited = time.monotonic()
    sip.transport.sendto(request.serialise(), server)
    ok, answered = await response_to(sip, request, 200)
    sip.transport.sendto(in_dialog(request, ok, "ACK", 1).serialise(), server)
    call_id = await asyncio.wait_for(app.arrived.get(), TIMEOUT)
    times = app.times.pop(call_id)
    bye = in_dialog(request, ok, "BYE", 2)
    sip.transport.sendto(bye.serialise(), server)
    await response_to(sip, bye, 200)
    while not rtp.queue.empty():
        rtp.queue.get_nowait()
    return {"invite_to_webhook_ms": (times["webhook"] - invited) * 1000,
            "accept_to_ok_ms": (answered - times["accept_sent"]) * 1000,
            "accept_request_ms": (times["accept_done"] - times["accept_sent"]) * 1000,
            "invite_to_ok_ms": (answered - invited) * 1000}


def percentiles(values: list[float]) -> dict[str, Any]:
    """summarize()'s figures (ms) with the 90th percentile beside them."""
    return {**summarize(values, 1.0), "p90": round(float(np.percentile(values, 90)), 2)}


async def bench(calls: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        sip_port = free_port()
        preset = write_preset(tmp / "preset.yaml", pipeline_mode="inproc", sip_port=sip_port,
                              rtp_ports="44100-44199")
        async with httpx.AsyncClient(timeout=TIMEOUT) as api:
            app = App(api)
            runner, hook_port = await serve_webhook(app)
            try:
                with run_server(preset, "--call-webhook", f"http://127.0.0.1:{hook_port}/calls",
                                "--call-webhook-secret", SECRET, tmp=tmp) as server:
                    api.base_url = httpx.URL(server.url)
                    sip, rtp = await open_udp(), await open_udp()
                    address = ("127.0.0.1", sip_port)
                    await one_call(app, sip, rtp, address, 0)  # warm-up: imports, first allocations
                    results = [await one_call(app, sip, rtp, address, n + 1) for n in range(calls)]
            finally:
                await runner.cleanup()
    return {"calls": results, "machine": machine(),
            **{name: percentiles([r[name] for r in results]) for name in MEASURES}}


def plot(results: dict[str, Any], path: Path) -> None:
    plot_calls(results, path, MEASURES, "Incoming SIP calls accepted through the webhook, toy preset")


def main() -> None:
    run_in_loopback_namespace("evaluation.webhook_bench")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20)
    results = asyncio.run(bench(parser.parse_args().calls))
    rows = [[name, results[name]["p50"], results[name]["p90"], results[name]["max"]] for name in MEASURES]
    print(format_table(["measure", "p50", "p90", "max"], rows))
    print(f"machine: {results['machine']}")
    save_results("webhook_bench", results, plot)


if __name__ == "__main__":
    main()
