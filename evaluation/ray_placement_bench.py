"""Stages as Ray actors (``placement: ray``) against local stage processes, on a small local Ray
cluster (``ray.cluster_utils.Cluster``: a head and two worker nodes on loopback, as the tests use).

- Transport: one round trip from a front end to an actor on a worker node carrying 1 KiB to
  4 MiB, as the argument of the actor call (what the Ray transport does: Ray inlines it under
  100 KiB and puts it in its object store above) against an explicit ``ray.put`` whose reference
  travels in the call and is read by the actor.
- The 5-stage relay chain (``relay_chain``, trivial compute; one actor per stage, spread over the
  nodes) against one process per stage: per-hop and end-to-end latency, text / 16 KiB / 256 KiB,
  and 16 clients at once (``evaluation.pipeline_overhead.measure_chain``, the same measurement).
- Abort to every stage acknowledged: on the idle chain, and on the toy preset at first audio.
- Throughput: the chain's actors served by 1 front end with 16 clients, then by 2 front ends with
  8 clients each, every front end its own process (as separate ``duplex.serve`` processes are),
  for a fixed time.

One run each. Prints a table and writes evaluation/results/ray_placement_bench.{json,png}.

    python -m evaluation.ray_placement_bench [--requests 200] [--aborts 100] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import ray

from evaluation.bench_common import (
    format_table,
    machine,
    run_in_loopback_namespace,
    save_figure,
    save_results,
    summarize,
)
from evaluation.pipeline_overhead import (
    PAYLOADS,
    _abort_at_first_audio,
    _abort_idle_id,
    _timed_chain_request,
    chain_rows,
    measure_aborts,
    measure_chain,
    toy_preset,
)
from harness.ray_cluster import local_cluster
from pipeline.config import PipelineConfig, parse_pipeline_config
from pipeline.models.toy.graphs import relay_chain
from pipeline.placement.ray_supervisor import remove_stages
from pipeline.runner import start_pipeline

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

NAMESPACE = "duplex-bench"
SIZES = {"1 KiB": 2**10, "16 KiB": 2**14, "256 KiB": 2**18, "4 MiB": 2**22}
CLIENTS = 16


def on_ray(config: PipelineConfig) -> PipelineConfig:
    """``config`` with every stage an actor of half a CPU, spread over the nodes."""
    data = config.model_dump()
    for stage in data["stages"]:
        stage["num_cpus"] = 0.5
    placed = {"placement": "ray", "ray_namespace": NAMESPACE, "ray_spread": True}
    return parse_pipeline_config({**data, **placed})


class Sink:
    """The far end of the transport measurement: takes a payload, or reads one by reference."""

    async def take(self, data: bytes) -> int:
        return len(data)

    async def take_ref(self, refs: list[Any]) -> int:
        return len(await refs[0])  # wrapped in a list, so that Ray passes the reference itself


async def measure_transport(rounds: int) -> dict[str, Any]:
    sink = ray.remote(Sink).options(num_cpus=0.1, scheduling_strategy="SPREAD").remote()
    result: dict[str, Any] = {}
    for label, size in SIZES.items():
        payload = os.urandom(size)
        timings: dict[str, list[float]] = {"argument": [], "ray.put + reference": []}
        for i in range(rounds + 10):  # the first 10 warm up
            started = time.perf_counter()
            await sink.take.remote(payload)
            middle = time.perf_counter()
            await sink.take_ref.remote([ray.put(payload)])
            ended = time.perf_counter()
            if i >= 10:
                timings["argument"].append(middle - started)
                timings["ray.put + reference"].append(ended - middle)
        result[label] = {how: summarize(values) for how, values in timings.items()}
    ray.kill(sink)
    return result


async def measure_mode(config: PipelineConfig, toy: PipelineConfig, requests: int,
                       aborts: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Chain latencies and abort-to-clear, in stage processes or (``placement: ray``) actors."""
    coordinator = await start_pipeline(config, mode="process")
    try:
        chain = await measure_chain(coordinator, requests)
        idle = await measure_aborts(coordinator, _abort_idle_id, aborts, 0, 0)
    finally:
        await coordinator.close()
    coordinator = await start_pipeline(toy, mode="process")
    try:
        at_audio = await measure_aborts(coordinator, _abort_at_first_audio, aborts, 0, 0)
    finally:
        await coordinator.close()
    return chain, {"chain, idle": summarize(idle), "toy at first audio, alone": summarize(at_audio)}


def _front_end(address: str, config: dict[str, Any], clients: int, start_at: float,
               seconds: float, results: Any) -> None:
    """One front-end process: joins the cluster, finds the stage actors, runs ``clients``."""
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    results.put(asyncio.run(_front_end_clients(parse_pipeline_config(config), clients, start_at,
                                               seconds)))


async def _front_end_clients(config: PipelineConfig, clients: int, start_at: float,
                             seconds: float) -> list[float]:
    coordinator = await start_pipeline(config)
    await asyncio.sleep(max(0.0, start_at - time.time()))
    deadline = time.perf_counter() + seconds

    async def client() -> list[float]:
        latencies = []
        while time.perf_counter() < deadline:
            latencies.append((await _timed_chain_request(coordinator, PAYLOADS["text"]))[-1])
        return latencies

    try:
        return [t for latencies in await asyncio.gather(*(client() for _ in range(clients)))
                for t in latencies]
    finally:
        await coordinator.close()


def measure_front_ends(address: str, config: PipelineConfig, seconds: float) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    result: dict[str, Any] = {}
    for fronts in (1, 2):
        queue = context.Queue()
        start_at = time.time() + 25  # every front end connected and warm by then
        processes = [
            context.Process(target=_front_end, args=(address, config.model_dump(),
                                                     CLIENTS // fronts, start_at, seconds, queue))
            for _ in range(fronts)
        ]
        for process in processes:
            process.start()
        latencies = [t for _ in processes for t in queue.get(timeout=seconds + 120)]
        for process in processes:
            process.join(30)
        result[f"{fronts} front end{'s' if fronts > 1 else ''}"] = {
            "clients": CLIENTS,
            "requests_per_s": round(len(latencies) / seconds, 1),
            "end_to_end": summarize(latencies),
        }
    return result


async def run(requests: int, aborts: int, seconds: float, address: str) -> dict[str, Any]:
    chain_config = relay_chain(5, max_in_flight=64)
    results: dict[str, Any] = {"chain": {}, "abort": {}}
    results["transport"] = await measure_transport(requests)
    for mode, chain, toy in (
        ("process", chain_config, toy_preset()),
        ("ray", on_ray(chain_config), on_ray(toy_preset())),
    ):
        results["chain"][mode], results["abort"][mode] = await measure_mode(
            chain, toy, requests, aborts
        )
    remove_stages(on_ray(toy_preset()))
    results["front_ends"] = await asyncio.to_thread(
        measure_front_ends, address, on_ray(chain_config), seconds
    )
    remove_stages(on_ray(chain_config))
    return results


def table(results: dict[str, Any]) -> str:
    rows: list[list[Any]] = []
    for size, ways in results["transport"].items():
        for how, s in ways.items():
            rows.append(["transport", f"front end -> actor round trip, {size}, {how}", s["p50"], s["p99"]])
    rows += chain_rows(results)
    for label, data in results["front_ends"].items():
        s = data["end_to_end"]
        measure = f"chain, {data['clients']} clients over {label}: {data['requests_per_s']} req/s"
        rows.append(["ray", measure, s["p50"], s["p99"]])
    return format_table(["mode", "measure", "p50 ms", "p99 ms"], rows)


def plot(results: dict[str, Any], path: Path) -> None:
    fig, (transport_ax, hops_ax, abort_ax, fronts_ax) = plt.subplots(1, 4, figsize=(24, 5))
    sizes = list(results["transport"])
    for offset, how in zip((-0.2, 0.2), ("argument", "ray.put + reference")):
        values = [results["transport"][size][how]["p50"] for size in sizes]
        transport_ax.bar(np.arange(len(sizes)) + offset, values, width=0.4, label=how)
    transport_ax.set_xticks(np.arange(len(sizes)), sizes)
    transport_ax.set(title="front end -> actor round trip (p50)", ylabel="ms")
    transport_ax.legend()
    for offset, mode in zip((-0.2, 0.2), results["chain"]):
        hops = results["chain"][mode]["text"]["hops"]
        x = np.arange(len(hops)) + offset
        hops_ax.bar(x, [s["p50"] for s in hops.values()], width=0.4, label=f"{mode} p50")
        hops_ax.scatter(x, [s["p99"] for s in hops.values()], marker="_", s=200, color="k")
        hops_ax.set_xticks(np.arange(len(hops)), list(hops), rotation=30, ha="right")
    hops_ax.set(title="per hop, text (bars p50, ticks p99)", ylabel="ms")
    hops_ax.legend()
    labels = list(results["abort"]["process"])
    for offset, mode in zip((-0.2, 0.2), results["abort"]):
        values = [results["abort"][mode][label]["p50"] for label in labels]
        abort_ax.bar(np.arange(len(labels)) + offset, values, width=0.4, label=f"{mode} p50")
    abort_ax.set_xticks(np.arange(len(labels)), labels)
    abort_ax.set(title="abort -> every stage acknowledged", ylabel="ms")
    abort_ax.legend()
    fronts = results["front_ends"]
    fronts_ax.bar(list(fronts), [d["requests_per_s"] for d in fronts.values()])
    fronts_ax.set(title=f"ray chain throughput, {CLIENTS} clients", ylabel="requests/s")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per payload and size")
    parser.add_argument("--aborts", type=int, default=100, help="aborts per case")
    parser.add_argument("--seconds", type=float, default=10.0, help="throughput run per case")
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.ray_placement_bench")
    with local_cluster(NAMESPACE, cpus_per_worker=4, object_store_mib=200) as cluster:
        results = asyncio.run(run(args.requests, args.aborts, args.seconds, cluster.address))
    results["machine"] = machine()
    print(table(results))
    save_results("ray_placement_bench", results, plot)


if __name__ == "__main__":
    main()
