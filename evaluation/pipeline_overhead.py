"""The pipeline framework's own cost, apart from model compute: in-process vs multi-process.

- per-hop latency and end-to-end latency of a 5-stage relay chain with trivial compute
  (``pipeline.models.toy.graphs.relay_chain``, one process per stage in multi-process mode): each
  relay stamps the monotonic clock when it runs, so every hop is measured on its own (coordinator
  -> r0, r0 -> r1, ..., r4 -> coordinator). Requests one at a time, text-only, with 0.25 s of
  16 kHz audio (16 KiB, inline) and with 4 s (256 KiB, shared memory across processes); then 16
  clients at once (throughput).
- abort to all-stages-clear (DESIGN.md's budget: <= 20 ms p99). On the chain: the framework alone
  (broadcast to 5 stages and their acks, nothing to wait for), idle and with 8 clients sending a
  request every 10 ms. On the toy preset (configs/toy.yaml): a request aborted at its first audio
  chunk while the thinker (5 ms steps) and talker (2 ms steps) work on it, so an abort also waits
  for the step in progress; alone and with 2 or 8 other requests streaming (the toy runs ~40x
  faster than real time: 8 streams saturate 2 cores). And, on the transport alone (process mode:
  one ZMQ endpoint to another, in this process), an Abort sent behind a backlog of
  ``BACKLOG`` queued data messages (16 KiB each): how long until the receiver takes it, and how
  many of the data messages it takes first (aborts have an urgent lane that overtakes data).

Prints a table and writes evaluation/results/pipeline_overhead.{json,png}; with ``--aborts-only``
only the toy preset's abort cases run (before/after a change on the abort path), written to
evaluation/results/pipeline_overhead_aborts{_LABEL}.{json,png}.

    python -m evaluation.pipeline_overhead [--requests 300] [--aborts 200]
    python -m evaluation.pipeline_overhead --aborts-only [--label after] [--aborts 200]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

from evaluation.bench_common import (
    format_table,
    machine,
    run_in_loopback_namespace,
    save_figure,
    save_results,
    summarize,
)
from pipeline.config import PipelineConfig, parse_pipeline_config, read_yaml
from pipeline.coordinator import Coordinator
from pipeline.models.toy.graphs import relay_chain
from pipeline.proto import Abort, OmniRequest, StagePayload, StreamChunk, new_request_id
from pipeline.runner import start_pipeline
from pipeline.transport.zmq_ipc import ZmqEndpoint

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

MODES = ("inproc", "process")
CHAIN_STAGES = 5
CLIENTS = 16
PACED_CLIENTS = 8
PACED_PERIOD_S = 0.01
BUDGET_ABORT_MS = 20.0
BACKLOG = 500
BACKLOG_RUNS = 100
ROOT = Path(__file__).resolve().parent.parent


def _turn(audio_samples: int) -> dict[str, Any]:
    audio = np.zeros(audio_samples, dtype=np.float32) if audio_samples else None
    return {"messages": [{"role": "user", "text": "hi", "audio": audio, "sample_rate": 16000}]}


PAYLOADS = {"text": _turn(0), "audio 16 KiB": _turn(4000), "audio 256 KiB": _turn(64000)}


async def _timed_chain_request(coordinator: Coordinator, inputs: dict[str, Any]) -> list[float]:
    """[coordinator -> r0, r0 -> r1, ..., r4 -> coordinator, end to end] in seconds."""
    started = time.perf_counter()
    async for chunk in coordinator.stream(OmniRequest(new_request_id(), inputs)):
        ended = time.perf_counter()
        stamps = [started] + [chunk.data[f"via_r{i}"] for i in range(CHAIN_STAGES)] + [ended]
    return [b - a for a, b in zip(stamps, stamps[1:])] + [ended - started]


async def measure_chain(coordinator: Coordinator, requests: int) -> dict[str, Any]:
    hop_names = ["coordinator->r0"] + [f"r{i}->r{i + 1}" for i in range(CHAIN_STAGES - 1)]
    hop_names.append(f"r{CHAIN_STAGES - 1}->coordinator")
    result: dict[str, Any] = {}
    for payload, inputs in PAYLOADS.items():
        for _ in range(20):  # warm-up: sockets connected, code paths hot
            await _timed_chain_request(coordinator, inputs)
        rows = np.array([await _timed_chain_request(coordinator, inputs) for _ in range(requests)])
        result[payload] = {
            "hops": {name: summarize(rows[:, i]) for i, name in enumerate(hop_names)},
            "end_to_end": summarize(rows[:, -1]),
            "end_to_end_raw_ms": (rows[:, -1] * 1000).round(3).tolist(),
        }
    started = time.perf_counter()
    per_client = max(1, requests // CLIENTS)
    rows = await asyncio.gather(*(
        _client(coordinator, PAYLOADS["text"], per_client) for _ in range(CLIENTS)
    ))
    elapsed = time.perf_counter() - started
    result[f"text, {CLIENTS} clients"] = {
        "end_to_end": summarize([r for client in rows for r in client]),
        "requests_per_s": round(CLIENTS * per_client / elapsed, 1),
    }
    return result


async def _client(coordinator: Coordinator, inputs: dict[str, Any], n: int) -> list[float]:
    return [(await _timed_chain_request(coordinator, inputs))[-1] for _ in range(n)]


async def _stream_until(coordinator: Coordinator, stop: asyncio.Event, period: float) -> None:
    """Background load: one request after the other, starting one at most every ``period`` s."""
    while not stop.is_set():
        started = time.perf_counter()
        async for _ in coordinator.stream(OmniRequest(new_request_id(), PAYLOADS["text"])):
            pass
        await asyncio.sleep(max(0.0, period - (time.perf_counter() - started)))


async def _abort_idle_id(coordinator: Coordinator) -> float:
    """The framework's own abort cost: broadcast and acks, no step to wait for."""
    started = time.perf_counter()
    await coordinator.abort(new_request_id())
    return time.perf_counter() - started


async def _abort_at_first_audio(coordinator: Coordinator) -> float:
    request = OmniRequest(new_request_id(), PAYLOADS["text"], {"toy_never_stop": True})
    stream = coordinator.stream(request)
    async for chunk in stream:
        if "audio" in chunk.data:
            break
    started = time.perf_counter()
    await coordinator.abort(request.request_id)
    elapsed = time.perf_counter() - started
    await stream.aclose()
    return elapsed


async def measure_aborts(
    coordinator: Coordinator,
    abort: Callable[[Coordinator], Awaitable[float]],
    aborts: int,
    background: int,
    period: float,
) -> list[float]:
    """Seconds from abort() until every stage acknowledged, ``aborts`` times, one at a time, while
    ``background`` clients stream requests."""
    stop = asyncio.Event()
    load = [asyncio.create_task(_stream_until(coordinator, stop, period)) for _ in range(background)]
    try:
        return [await abort(coordinator) for _ in range(aborts)]
    finally:
        stop.set()
        await asyncio.gather(*load)


async def measure_abort_behind_backlog(runs: int) -> tuple[list[float], list[int]]:
    """Seconds from sending an Abort behind ``BACKLOG`` data messages until the receiving
    endpoint hands it out, and how many data messages it handed out before, ``runs`` times."""
    directory = Path(tempfile.mkdtemp(prefix="duplex-bench-"))
    sender = ZmqEndpoint("sender", directory, 1 << 20)
    receiver = ZmqEndpoint("receiver", directory, 1 << 20)
    chunk = StreamChunk(StagePayload("busy", {"audio": np.zeros(4000, np.float32)}), "sender", 0)
    clear: list[float] = []
    overtaken: list[int] = []
    try:
        for run in range(runs):
            for _ in range(BACKLOG):
                sender.send("receiver", chunk)
            started = time.perf_counter()
            sender.send("receiver", Abort(f"abort-{run}"))
            taken_before = 0
            while not isinstance(await receiver.recv(), Abort):
                taken_before += 1
            clear.append(time.perf_counter() - started)
            overtaken.append(taken_before)
            for _ in range(BACKLOG - taken_before):  # the rest of the backlog, before the next run
                await receiver.recv()
    finally:
        sender.close()
        receiver.close()
        shutil.rmtree(directory, ignore_errors=True)
    return clear, overtaken


def _abort_summary(clear: list[float]) -> dict[str, Any]:
    return {**summarize(clear), "raw_ms": (np.array(clear) * 1000).round(3).tolist()}


def toy_preset() -> PipelineConfig:
    return parse_pipeline_config(read_yaml(ROOT / "configs" / "toy.yaml")["pipeline"])


async def run(requests: int, aborts: int, aborts_only: bool = False) -> dict[str, Any]:
    results: dict[str, Any] = {"chain": {}, "abort": {}}
    for mode in MODES:
        cases = results["abort"][mode] = {}
        if not aborts_only:
            await _run_chain(results, cases, mode, requests, aborts)
        coordinator = await start_pipeline(toy_preset(), mode=mode)
        try:
            for background in (0, 2, 8):
                clear = await measure_aborts(coordinator, _abort_at_first_audio, aborts, background, 0)
                label = f"{background} streaming" if background else "alone"
                cases[f"toy at first audio, {label}"] = _abort_summary(clear)
        finally:
            await coordinator.close()
    clear, taken_before = await measure_abort_behind_backlog(BACKLOG_RUNS)
    results["abort"]["process"][f"transport, behind {BACKLOG} queued messages"] = {
        **_abort_summary(clear), "data_taken_before_abort": summarize(taken_before, scale=1.0),
    }
    return results


async def _run_chain(
    results: dict[str, Any], cases: dict[str, Any], mode: str, requests: int, aborts: int
) -> None:
    coordinator = await start_pipeline(relay_chain(CHAIN_STAGES, max_in_flight=64), mode=mode)
    try:
        results["chain"][mode] = await measure_chain(coordinator, requests)
        for label, background in (("idle", 0), (f"{PACED_CLIENTS} clients", PACED_CLIENTS)):
            clear = await measure_aborts(coordinator, _abort_idle_id, aborts, background, PACED_PERIOD_S)
            cases[f"chain, {label}"] = _abort_summary(clear)
    finally:
        await coordinator.close()


def table(results: dict[str, Any]) -> str:
    return format_table(["mode", "measure", "p50 ms", "p99 ms"], chain_rows(results))


def chain_rows(results: dict[str, Any]) -> list[list[Any]]:
    """Table rows of the ``chain`` (hops, end to end) and ``abort`` results, per mode."""
    rows: list[list[Any]] = []
    for mode, chain in results["chain"].items():
        for payload, data in chain.items():
            for hop, s in data.get("hops", {}).items():
                rows.append([mode, f"hop {hop} ({payload})", s["p50"], s["p99"]])
            s = data["end_to_end"]
            rate = f", {data['requests_per_s']} req/s" if "requests_per_s" in data else ""
            rows.append([mode, f"5-stage chain end to end ({payload}{rate})", s["p50"], s["p99"]])
    for mode, cases in results["abort"].items():
        for label, s in cases.items():
            rows.append([mode, f"abort -> all stages clear ({label})", s["p50"], s["p99"]])
    return rows


def plot_aborts(results: dict[str, Any], path: Path) -> None:
    """The abort cases alone (``--aborts-only``): CDF of abort -> every stage acknowledged."""
    fig, ax = plt.subplots(figsize=(9, 5))
    for mode in MODES:
        for label, data in results["abort"][mode].items():
            raw = np.sort(data["raw_ms"])
            ax.plot(raw, np.linspace(0, 1, len(raw)), label=f"{mode}, {label}")
    ax.axvline(BUDGET_ABORT_MS, color="r", linestyle="--", label="budget (p99)")
    ax.set(title="abort -> every stage acknowledged", xlabel="ms", ylabel="CDF")
    ax.set_xscale("log")
    ax.legend(fontsize="small")
    save_figure(fig, path)


def plot(results: dict[str, Any], path: Path) -> None:
    fig, (hops_ax, e2e_ax, abort_ax) = plt.subplots(1, 3, figsize=(20, 5))
    for offset, mode in zip((-0.2, 0.2), MODES):
        hops = results["chain"][mode]["text"]["hops"]
        x = np.arange(len(hops)) + offset
        hops_ax.bar(x, [s["p50"] for s in hops.values()], width=0.4, label=f"{mode} p50")
        hops_ax.scatter(x, [s["p99"] for s in hops.values()], marker="_", s=200, color="k")
        hops_ax.set_xticks(np.arange(len(hops)), list(hops), rotation=30, ha="right")
    hops_ax.set(title="per hop, text payload (bars p50, ticks p99)", ylabel="ms")
    hops_ax.legend()
    for mode in MODES:
        for payload in PAYLOADS:
            raw = np.sort(results["chain"][mode][payload]["end_to_end_raw_ms"])
            e2e_ax.plot(raw, np.linspace(0, 1, len(raw)), label=f"{mode}, {payload}")
        for label, data in results["abort"][mode].items():
            raw = np.sort(data["raw_ms"])
            abort_ax.plot(raw, np.linspace(0, 1, len(raw)), label=f"{mode}, {label}")
    e2e_ax.set(title=f"{CHAIN_STAGES}-stage relay chain, end to end", xlabel="ms", ylabel="CDF")
    e2e_ax.set_xscale("log")
    e2e_ax.legend()
    abort_ax.axvline(BUDGET_ABORT_MS, color="r", linestyle="--", label="budget (p99)")
    abort_ax.set(title="abort -> every stage acknowledged", xlabel="ms", ylabel="CDF")
    abort_ax.set_xscale("log")
    abort_ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5))
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="chain requests per payload")
    parser.add_argument("--aborts", type=int, default=200, help="aborts per case")
    parser.add_argument("--aborts-only", action="store_true", help="only the toy preset's aborts")
    parser.add_argument("--label", default="", help="suffix of the --aborts-only result files")
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.pipeline_overhead")
    results = asyncio.run(run(args.requests, args.aborts, args.aborts_only))
    results["machine"] = machine()
    print(table(results))
    if args.aborts_only:
        name = "pipeline_overhead_aborts" + (f"_{args.label}" if args.label else "")
        save_results(name, results, plot_aborts)
    else:
        save_results("pipeline_overhead", results, plot)


if __name__ == "__main__":
    main()
