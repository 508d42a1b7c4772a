"""``python -m evaluation.hostile_latency``: how much one hostile client slows another session.

A victim session (a Realtime WebSocket user of evaluation/speaking_client.py on the ``toy``
preset) asks the same spoken question turn after turn and times each answer: from its last append
to the answer's first audio delta (the end-of-turn silence is in the audio, so this is the
server's own work: VAD, turn end, pipeline, first audio). Meanwhile a prober times ``GET
/healthz`` every 100 ms. That runs once idle, then once beside each attacker, which runs in a
process of its own (so that its client-side work does not slow the victim's client):

- ``event flood``: garbage and unknown events as fast as the socket takes them, reconnecting each
  time the server closes the connection for flooding (1008);
- ``huge appends``: 10 MB of base64 audio (~3.5 min at 24 kHz) per event, without pause;
- ``deaf client``: asks for answers and never reads, until the server closes it, again and again;
- ``big offers``: WebRTC offers of 64 KiB holding thousands of ICE candidates, without pause;
- ``cpu hog`` (a control, not an attack): a process that only spins, touching no server. On a
  2-core machine every attacker takes a core from the server too; this shows how much of the
  slowdown is that alone.

Printed and written (``evaluation/results/hostile_latency.json`` and ``.png``): the victim's turn
latency p50 / p90 and its ratio to idle (target ≤ 2×), and /healthz p50 / p99 / max. Runs itself in
a loopback-only namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import multiprocessing
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import matplotlib
import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from evaluation.bench_common import (
    format_table,
    machine,
    run_in_loopback_namespace,
    save_figure,
    save_results,
    summarize,
)
from evaluation.speaking_client import QUESTION, speaking_session, utterance
from harness.server import ServerProcess, run_server, write_preset

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HEALTH_EVERY_S = 0.1
HUGE_APPEND_BYTES = 10 * 1024 * 1024
OFFER_CANDIDATES = 2000


# The attacker is another client than the victim: limits per client address must not count the
# victim's session against the attacker's (on loopback, 127.0.0.0/8 is all this machine's).
ATTACKER_ADDRESS = "127.0.0.2"


async def _reconnecting(url: str, attack: Callable[[Any], Awaitable[None]]) -> None:
    """Run ``attack(ws)`` on a fresh connection each time the server ends the last one."""
    while True:
        try:
            async with connect(url, max_size=None, local_addr=(ATTACKER_ADDRESS, 0)) as ws:
                await attack(ws)
        except (ConnectionClosed, InvalidStatus, OSError):
            await asyncio.sleep(0.05)  # the server refused or closed us: back after a breath


async def _flood(ws: Any) -> None:
    garbage = ["{not json", json.dumps({"type": "no.such.event"}),
               json.dumps({"type": "session.update", "session": {"audio": "x"}})]
    for message in itertools.cycle(garbage):
        await ws.send(message)


async def _huge_appends(ws: Any) -> None:
    audio = base64.b64encode(bytes(HUGE_APPEND_BYTES * 3 // 4)).decode("ascii")
    while True:
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))


async def _deaf(ws: Any) -> None:
    """Ask for answers and never read: the server's unsent events pile up until it closes us."""
    while True:
        await ws.send(json.dumps({"type": "response.create", "response": {"output_modalities": ["text"]}}))
        await asyncio.sleep(0.05)


async def _big_offers(base: str) -> None:
    candidates = "".join(f"a=candidate:{n} 1 udp 2122260223 10.{n // 65536 % 256}.{n // 256 % 256}."
                         f"{n % 256} {1024 + n % 60000} typ host\r\n" for n in range(OFFER_CANDIDATES))
    offer = ("v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n"
             "c=IN IP4 0.0.0.0\r\na=rtpmap:111 opus/48000/2\r\n" + candidates)[: 64 * 1024]
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            await client.post(f"{base}/v1/realtime/calls", content=offer,
                              headers={"Content-Type": "application/sdp"})


async def _spin() -> None:
    while True:
        sum(range(100_000))  # CPU only, nothing awaited: the loop never yields


def attacker_process(kind: str, base: str) -> None:
    """The attacker process's body: one attack until the process is terminated."""
    url = base.replace("http", "ws", 1) + "/v1/realtime?model=gpt-realtime"
    attacks: dict[str, Callable[[], Awaitable[None]]] = {
        "event flood": lambda: _reconnecting(url, _flood),
        "huge appends": lambda: _reconnecting(url, _huge_appends),
        "deaf client": lambda: _reconnecting(url, _deaf),
        "big offers": lambda: _big_offers(base),
        "cpu hog": _spin,
    }
    asyncio.run(attacks[kind]())


async def _probe_health(base: str, times: list[float], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            began = time.perf_counter()
            await client.get(f"{base}/healthz")
            times.append(time.perf_counter() - began)
            await asyncio.sleep(HEALTH_EVERY_S)  # the probing rate, not a wait for anything


async def victim_turns(server: ServerProcess, turns: int) -> list[float]:
    """Seconds from the last append of each question to its answer's first audio delta."""
    question = utterance(QUESTION)
    latencies = []
    async with speaking_session(server) as session:
        for seen in range(turns):
            await session.say(question)
            said = time.perf_counter()
            response_id = await session.next_response(seen)
            await session.first_audio(response_id)
            latencies.append(time.perf_counter() - said)
            await session.done(response_id)
    return latencies


@contextlib.contextmanager
def toy_server() -> Iterator[ServerProcess]:
    """The server the victim talks to: the toy preset, answers of 12 tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        preset = write_preset(Path(tmp) / "preset.yaml", stages={"thinker": {"options": {"answer_tokens": 12}}})
        with run_server(preset, tmp=Path(tmp)) as server:
            yield server


@contextlib.asynccontextmanager
async def under_attack(server: ServerProcess, attack: str | None) -> AsyncIterator[None]:
    """``attack`` on ``server`` from a process of its own (None: no attack), from when it has
    reached its stride (2 s) until the block ends."""
    if attack is None:
        yield
        return
    attacker = multiprocessing.get_context("spawn").Process(
        target=attacker_process, args=(attack, server.url), daemon=True)
    attacker.start()
    try:
        await asyncio.sleep(2.0)  # let the attack reach its stride before the victim speaks
        yield
    finally:
        attacker.terminate()
        attacker.join()


async def measure(server: ServerProcess, attack: str | None, turns: int) -> dict[str, Any]:
    health: list[float] = []
    stop = asyncio.Event()
    prober = asyncio.get_running_loop().create_task(_probe_health(server.url, health, stop))
    try:
        async with under_attack(server, attack):
            latencies = await victim_turns(server, turns)
    finally:
        stop.set()
        await prober
    return {"turn_ms": summarize(latencies), "turn_p90_ms": round(float(np.percentile(latencies, 90)) * 1000, 1),
            "healthz_ms": summarize(health), "server_alive": server.process.poll() is None}


async def run(turns: int) -> dict[str, Any]:
    with toy_server() as server:
        await victim_turns(server, 2)  # warm-up
        scenarios: dict[str, Any] = {}
        for attack in (None, "cpu hog", "event flood", "huge appends", "deaf client", "big offers"):
            name = attack or "idle"
            scenarios[name] = await measure(server, attack, turns)
            print(name, scenarios[name], flush=True)
    idle, hog = scenarios["idle"]["turn_ms"]["p50"], scenarios["cpu hog"]["turn_ms"]["p50"]
    for result in scenarios.values():
        result["ratio_to_idle"] = round(result["turn_ms"]["p50"] / idle, 2)
        result["ratio_to_cpu_hog"] = round(result["turn_ms"]["p50"] / hog, 2)
    return {"machine": machine(), "turns": turns, "scenarios": scenarios}


def plot(results: dict[str, Any], path: Path) -> None:
    names = list(results["scenarios"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [results["scenarios"][n]["turn_ms"]["p50"] for n in names])
    left.set_ylabel("victim: last append -> first audio, p50 (ms)")
    right.bar(names, [results["scenarios"][n]["healthz_ms"]["p99"] for n in names])
    right.set_ylabel("/healthz p99 (ms)")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("one session beside a hostile client (toy preset)")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.hostile_latency")
    results = asyncio.run(run(args.turns))
    rows = [[name, r["turn_ms"]["p50"], r["turn_p90_ms"], r["ratio_to_idle"], r["ratio_to_cpu_hog"],
             r["healthz_ms"]["p50"], r["healthz_ms"]["p99"], r["healthz_ms"]["max"], r["server_alive"]]
            for name, r in results["scenarios"].items()]
    print(format_table(["attacker", "victim turn p50 ms", "p90", "÷ idle", "÷ cpu hog", "/healthz p50 ms",
                        "p99", "max", "server alive"], rows))
    save_results("hostile_latency", results, plot)


if __name__ == "__main__":
    main()
