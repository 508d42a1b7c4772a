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
- ``bulk items``: 64 ``conversation.item.create`` with 119 s of audio each, again and again;
- ``30 s appends``: appends of 30 s of audio each (within the audio budget's burst), back to back;
- ``out-of-band flood``: 60 ``response.create`` with ``conversation: "none"`` (text) at once, again
  as soon as they are answered or refused;
- ``unauthenticated twilio``: as many Twilio media-stream sockets as the server has session slots,
  that never send ``start`` (no token), reopened when closed;
- ``connection burst``: 200 Realtime WebSocket connections opened at once, every second;
- ``cpu hog`` (a control, not an attack): a process that only spins, touching no server. On a
  2-core machine every attacker takes a core from the server too; this shows how much of the
  slowdown is that alone.

Printed and written (``evaluation/results/hostile_latency.json`` and ``.png``): the victim's turn
latency p50 / p90 and its ratio to idle (target ≤ 2×), /healthz p50 / p99 / max, and the event loop's
lag p99 / max (``duplex_event_loop_lag_seconds``, read from /metrics before and after each scenario:
the upper bound of the bucket that holds them). The server has an API key: every attacker but the
Twilio one presents it (a hostile client that has a key is the harder case). Runs itself in a
loopback-only namespace.
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
API_KEY = "hostile-latency-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_SESSIONS = 8
WIRE_RATE = 24000  # audio/pcm of the Realtime API: 24 kHz s16 mono
BULK_ITEMS = 64
BULK_ITEM_S = 119
APPEND_S = 30
OUT_OF_BAND = 60
BURST_CONNECTIONS = 200
LAG_METRIC = "duplex_event_loop_lag_seconds"


# The attacker is another client than the victim: limits per client address must not count the
# victim's session against the attacker's (on loopback, 127.0.0.0/8 is all this machine's).
ATTACKER_ADDRESS = "127.0.0.2"


async def _reconnecting(url: str, attack: Callable[[Any], Awaitable[None]]) -> None:
    """Run ``attack(ws)`` on a fresh connection each time the server ends the last one."""
    while True:
        try:
            async with connect(url, max_size=None, local_addr=(ATTACKER_ADDRESS, 0),
                               additional_headers=AUTH) as ws:
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


def _audio(seconds: float) -> str:
    """``seconds`` of quiet noise as the Realtime API's base64 audio/pcm."""
    samples = np.random.default_rng(0).integers(-300, 300, int(seconds * WIRE_RATE), dtype=np.int16)
    return base64.b64encode(samples.tobytes()).decode("ascii")


async def _bulk_items(ws: Any) -> None:
    item = json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user",
        "content": [{"type": "input_audio", "audio": _audio(BULK_ITEM_S)}]}})
    while True:
        for _ in range(BULK_ITEMS):
            await ws.send(item)
        await ws.recv()  # something came back (created or refused): send the next batch


async def _long_appends(ws: Any) -> None:
    append = json.dumps({"type": "input_audio_buffer.append", "audio": _audio(APPEND_S)})
    while True:
        await ws.send(append)
        await ws.recv()


async def _out_of_band(ws: Any) -> None:
    create = json.dumps({"type": "response.create",
                         "response": {"conversation": "none", "output_modalities": ["text"]}})
    while True:
        for _ in range(OUT_OF_BAND):
            await ws.send(create)
        ended = 0
        while ended < OUT_OF_BAND:  # each create ends in response.done or an error
            event = json.loads(await ws.recv())
            ended += event["type"] in ("response.done", "error")


async def _unauthenticated_twilio(base: str) -> None:
    """Hold as many Twilio sockets as there are slots, none sending ``start``; reopen closed ones."""
    url = base.replace("http", "ws", 1) + "/v1/telephony/twilio"

    async def hold() -> None:
        while True:
            try:
                async with connect(url, local_addr=(ATTACKER_ADDRESS, 0)) as ws:
                    await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
                    await ws.wait_closed()
            except (ConnectionClosed, InvalidStatus, OSError):
                pass
            await asyncio.sleep(0.05)  # closed or refused: back after a breath

    await asyncio.gather(*(hold() for _ in range(MAX_SESSIONS)))


async def _connection_burst(url: str) -> None:
    async def one() -> None:
        with contextlib.suppress(ConnectionClosed, InvalidStatus, OSError, TimeoutError):
            async with connect(url, local_addr=(ATTACKER_ADDRESS, 0), additional_headers=AUTH,
                               open_timeout=10):
                pass

    while True:
        began = time.monotonic()
        await asyncio.gather(*(one() for _ in range(BURST_CONNECTIONS)))
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - began)))  # one burst a second


async def _big_offers(base: str) -> None:
    candidates = "".join(f"a=candidate:{n} 1 udp 2122260223 10.{n // 65536 % 256}.{n // 256 % 256}."
                         f"{n % 256} {1024 + n % 60000} typ host\r\n" for n in range(OFFER_CANDIDATES))
    offer = ("v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n"
             "c=IN IP4 0.0.0.0\r\na=rtpmap:111 opus/48000/2\r\n" + candidates)[: 64 * 1024]
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            await client.post(f"{base}/v1/realtime/calls", content=offer,
                              headers={"Content-Type": "application/sdp", **AUTH})


async def _spin() -> None:
    while True:
        sum(range(100_000))  # CPU only, nothing awaited: the loop never yields


def attacker_process(kind: str, base: str, started: Any) -> None:
    """The attacker process's body: one attack until the process is terminated; ``started`` (a
    multiprocessing Event) is set once its imports are done and the attack begins."""
    url = base.replace("http", "ws", 1) + "/v1/realtime?model=gpt-realtime"
    attacks: dict[str, Callable[[], Awaitable[None]]] = {
        "event flood": lambda: _reconnecting(url, _flood),
        "huge appends": lambda: _reconnecting(url, _huge_appends),
        "deaf client": lambda: _reconnecting(url, _deaf),
        "big offers": lambda: _big_offers(base),
        "bulk items": lambda: _reconnecting(url, _bulk_items),
        "30 s appends": lambda: _reconnecting(url, _long_appends),
        "out-of-band flood": lambda: _reconnecting(url, _out_of_band),
        "unauthenticated twilio": lambda: _unauthenticated_twilio(base),
        "connection burst": lambda: _connection_burst(url),
        "cpu hog": _spin,
    }
    started.set()
    asyncio.run(attacks[kind]())


async def _probe_health(base: str, times: list[float], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            began = time.perf_counter()
            await client.get(f"{base}/healthz")
            times.append(time.perf_counter() - began)
            await asyncio.sleep(HEALTH_EVERY_S)  # the probing rate, not a wait for anything


class VictimFailed(RuntimeError):
    """A victim's turn was not answered (refused, or failed)."""


async def victim_turns(server: ServerProcess, turns: int) -> list[float]:
    """Seconds from the last append of each question to its answer's first audio delta."""
    question = utterance(QUESTION)
    latencies = []
    async with speaking_session(server, API_KEY) as session:
        for seen in range(turns):
            await session.say(question)
            said = time.perf_counter()
            response_id = await session.next_response(seen)
            if not await session.first_audio(response_id):
                raise VictimFailed(f"turn {seen} ended without audio ({session.error_codes[-1:]})")
            latencies.append(time.perf_counter() - said)
            await session.done(response_id)
    return latencies


@contextlib.contextmanager
def toy_server() -> Iterator[ServerProcess]:
    """The server the victim talks to: the toy preset, answers of 12 tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        preset = write_preset(Path(tmp) / "preset.yaml", stages={"thinker": {"options": {"answer_tokens": 12}}},
                              api_key=API_KEY, max_sessions=MAX_SESSIONS)
        with run_server(preset, tmp=Path(tmp)) as server:
            yield server


@contextlib.asynccontextmanager
async def under_attack(server: ServerProcess, attack: str | None) -> AsyncIterator[None]:
    """``attack`` on ``server`` from a process of its own (None: no attack), from when it has
    reached its stride (2 s) until the block ends."""
    if attack is None:
        yield
        return
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    attacker = context.Process(target=attacker_process, args=(attack, server.url, started), daemon=True)
    attacker.start()
    try:
        # A spawned process takes seconds to import on a loaded machine: its stride is timed from
        # when it begins.
        if not await asyncio.to_thread(started.wait, 60):
            raise RuntimeError(f"the {attack!r} attacker did not start")
        await asyncio.sleep(2.0)  # let the attack reach its stride before the victim speaks
        yield
    finally:
        attacker.terminate()
        attacker.join()


def lag_buckets(server: ServerProcess) -> dict[float, float]:
    """The loop-lag histogram's cumulative bucket counts, by upper bound (a missing metric fails)."""
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=30).text
    buckets = {}
    for line in text.splitlines():
        if line.startswith(f"{LAG_METRIC}_bucket{{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(bound)] = float(line.rpartition(" ")[2])
    if not buckets:
        raise RuntimeError(f"no {LAG_METRIC} in /metrics")
    return buckets


def lag_summary(before: dict[float, float], after: dict[float, float]) -> dict[str, float | None]:
    """p99 and max of the loop's lag between two readings, each as the upper bound (seconds) of
    the bucket that holds it; None for a max beyond the last finite bucket."""
    counts = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    total = counts[float("inf")]

    def bound_of(share: float) -> float | None:
        bound = next(b for b, n in counts.items() if n >= share * total)
        return None if bound == float("inf") else bound

    return {"samples": total, "p99_le_s": bound_of(0.99), "max_le_s": bound_of(1.0)}


async def measure(server: ServerProcess, attack: str | None, turns: int) -> dict[str, Any]:
    health: list[float] = []
    stop = asyncio.Event()
    prober = asyncio.get_running_loop().create_task(_probe_health(server.url, health, stop))
    lag_before = lag_buckets(server)
    refused = None
    latencies: list[float] = []
    try:
        async with under_attack(server, attack):
            try:
                latencies = await victim_turns(server, turns)
            except (ConnectionError, ConnectionClosed, InvalidStatus, TimeoutError, VictimFailed) as err:
                refused = f"{type(err).__name__}: {err}"  # the attack kept the victim out
    finally:
        stop.set()
        await prober
    result: dict[str, Any] = {
        "healthz_ms": summarize(health), "loop_lag": lag_summary(lag_before, lag_buckets(server)),
        "server_alive": server.process.poll() is None, "victim_refused": refused}
    if latencies:
        result.update(turn_ms=summarize(latencies),
                      turn_p90_ms=round(float(np.percentile(latencies, 90)) * 1000, 1))
    return result


async def run(turns: int) -> dict[str, Any]:
    with toy_server() as server:
        await victim_turns(server, 2)  # warm-up
        scenarios: dict[str, Any] = {}
        for attack in (None, "cpu hog", "event flood", "huge appends", "deaf client", "big offers",
                       "bulk items", "30 s appends", "out-of-band flood", "unauthenticated twilio",
                       "connection burst"):
            name = attack or "idle"
            scenarios[name] = await measure(server, attack, turns)
            print(name, scenarios[name], flush=True)
    idle, hog = scenarios["idle"]["turn_ms"]["p50"], scenarios["cpu hog"]["turn_ms"]["p50"]
    for result in scenarios.values():
        if "turn_ms" in result:
            result["ratio_to_idle"] = round(result["turn_ms"]["p50"] / idle, 2)
            result["ratio_to_cpu_hog"] = round(result["turn_ms"]["p50"] / hog, 2)
    return {"machine": machine(), "turns": turns, "scenarios": scenarios}


def plot(results: dict[str, Any], path: Path) -> None:
    names = list(results["scenarios"])
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.5))
    scenarios = results["scenarios"]
    left.bar(names, [scenarios[n].get("turn_ms", {}).get("p50", 0.0) for n in names])
    left.set_ylabel("victim: last append -> first audio, p50 (ms; 0: refused)")
    middle.bar(names, [scenarios[n]["healthz_ms"]["p99"] for n in names])
    middle.set_ylabel("/healthz p99 (ms)")
    right.bar(names, [(scenarios[n]["loop_lag"]["p99_le_s"] or 2.0) * 1000 for n in names])
    right.set_ylabel("event loop lag p99, bucket bound (ms)")
    for ax in (left, middle, right):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("one session beside a hostile client (toy preset)")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.hostile_latency")
    results = asyncio.run(run(args.turns))
    rows = [[name, r.get("turn_ms", {}).get("p50", "refused"), r.get("turn_p90_ms", "-"),
             r.get("ratio_to_idle", "-"), r.get("ratio_to_cpu_hog", "-"), r["healthz_ms"]["p50"],
             r["healthz_ms"]["p99"], r["healthz_ms"]["max"], r["loop_lag"]["p99_le_s"],
             r["loop_lag"]["max_le_s"], r["server_alive"]]
            for name, r in results["scenarios"].items()]
    print(format_table(["attacker", "victim turn p50 ms", "p90", "÷ idle", "÷ cpu hog", "/healthz p50 ms",
                        "p99", "max", "loop lag p99 ≤ s", "max ≤ s", "server alive"], rows))
    save_results("hostile_latency", results, plot)


if __name__ == "__main__":
    main()
