"""What an event flood costs the server, round by round: the CPU of its main process and the
victim's turn latency while one client floods (the ``event flood`` attacker of
:mod:`evaluation.hostile_latency`, from its own loopback address, reconnecting each time it is
closed).

    python -m evaluation.flood_cost [--rounds 3]

Each round starts a fresh server on the toy preset, lets the flood reach its stride (2 s), then
has the victim ask 10 spoken questions while the server's CPU time is read from ``/proc``. The
flood's cost swings with where the attacker's reconnection cycle falls, so the rounds are printed
one by one and summarised by their median. Writes ``evaluation/results/flood_cost.json``. Runs
itself in a loopback-only namespace.

Nothing here holds state between calls.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from evaluation.bench_common import (
    format_table,
    machine,
    run_in_loopback_namespace,
    save_figure,
    save_results,
)
from evaluation.hostile_latency import toy_server, under_attack, victim_turns
from evaluation.proc_cpu import process_seconds

NAME = "flood_cost"
TURNS = 10


async def one_round() -> dict[str, float]:
    with toy_server() as server:
        await victim_turns(server, 2)  # warm-up
        async with under_attack(server, "event flood"):
            cpu, began = process_seconds(server.process.pid), time.monotonic()
            latencies = await victim_turns(server, TURNS)
            cpu = (process_seconds(server.process.pid) - cpu) / (time.monotonic() - began)
    return {"server_cpu_percent": round(100 * cpu, 1),
            "victim_p50_ms": round(1000 * statistics.median(latencies), 1)}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = results["rounds"]
    names = [str(i + 1) for i in range(len(rounds))]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.bar(names, [r["server_cpu_percent"] for r in rounds])
    left.set_ylabel("server main process, % of a core")
    right.bar(names, [r["victim_p50_ms"] for r in rounds])
    right.set_ylabel("victim turn p50 (ms)")
    for ax in (left, right):
        ax.set_xlabel("round")
    fig.suptitle("one session beside an event flood (toy preset)")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.flood_cost")
    rounds = [asyncio.run(one_round()) for _ in range(args.rounds)]
    summary: dict[str, Any] = {
        key: statistics.median(r[key] for r in rounds) for key in ("server_cpu_percent", "victim_p50_ms")}
    print(format_table(["round", "server main process CPU %", "victim turn p50 ms"],
                       [[i + 1, r["server_cpu_percent"], r["victim_p50_ms"]] for i, r in enumerate(rounds)]
                       + [["median", summary["server_cpu_percent"], summary["victim_p50_ms"]]]))
    save_results(NAME, {"machine": machine(), "turns": TURNS, "rounds": rounds, "median": summary},
                 plot)


if __name__ == "__main__":
    main()
