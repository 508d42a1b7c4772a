"""The session server end to end: voice-to-voice latency and its parts, barge-in, abort-to-clear,
outbound pacing, CPU per session and how many concurrent calls run without an underrun.

    python -m evaluation.duplex_bench [--preset toy | --config FILE]
        [--step-delay STAGE=SECONDS ...] [--paced [STAGE.OPTION=VALUE ...]]

Real ``duplex.serve`` processes, started through evaluation/server_probe.py (which timestamps
public calls inside the server), and real aiortc client calls speaking espeak-ng speech
(evaluation/duplex_calls.py). The script re-executes itself in a network namespace that holds only
loopback (root, ``unshare --net``), as ``make test`` does. About 3 minutes in all:

- server A, the preset as it is (toy by default: next to no model compute, so that the framework's
  own costs show; ``--step-delay thinker=0.03`` makes a stage sleep per step to mimic a model):
  1. idle: the server's CPU with no call;
  2. turns: one call asks ``--turns`` short questions in a row (voice-to-voice and its parts);
- server B, the same preset *paced* (``--paced``; for the toy by default a thinker at 20 ms a token
  with 24-token answers and a talker at 30 ms per 80 ms frame, i.e. a model that speaks 2.7 times
  faster than it is heard, as a GPU would): the toy alone writes a whole answer in ~50 ms, so an
  interruption would find nothing left to abort and the playout queue could never run dry;
  3. barge-ins: one call interrupts ``--barge-ins`` answers 1.2 s into each (pause, abort-to-clear);
  4. ramp: ``--sessions`` calls at once (1, 2, 4, 8), ``--ramp-turns`` questions each (pacing,
     underruns, CPU per session); a level is sustained with no underrun and pacing p99 <= 25 ms;
- VAD CPU (evaluation/vad_cpu.py) in a subprocess, once the servers are gone.

Prints a table and writes evaluation/results/duplex_bench.json, duplex_bench.png, the servers'
logs and the probes' records. Timings are noisy on a shared 2-core machine: the tables show what
else was using the CPU during each phase ("other cores").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from duplex.settings import load_preset
from evaluation import duplex_calls as calls
from evaluation import duplex_report as report
from evaluation.bench_common import (
    RESULTS_DIR,
    ROOT,
    apply_stage_changes,
    run_in_loopback_namespace,
    write_json,
)
from evaluation.duplex_analysis import Probe
from evaluation.duplex_plots import plot
from evaluation.duplex_report import Phase
from harness.server import ServerProcess, _wait_healthy, free_port

NAME = "duplex_bench"
IDLE_SECONDS = 3.0
TOY_PACING = ["thinker.step_delay_s=0.02", "thinker.answer_tokens=24", "talker.step_delay_s=0.03"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--preset", default="toy", help="configs/NAME.yaml (default toy)")
    where.add_argument("--config", type=Path, help="a preset file from anywhere")
    p.add_argument("--step-delay", action="append", default=[], metavar="STAGE=SECONDS",
                   help="both servers: STAGE sleeps this long per step (runners that take "
                   "step_delay_s, as the toy's)")
    p.add_argument("--paced", nargs="*", metavar="STAGE.OPTION=VALUE",
                   help="server B's extra stage options (default for the toy: "
                   f"{' '.join(TOY_PACING)}; elsewhere none); --paced alone: none")
    p.add_argument("--sessions", default="1,2,4,8", help="ramp levels (concurrent calls)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--barge-ins", type=int, default=10)
    p.add_argument("--ramp-turns", type=int, default=2)
    p.add_argument("--vad-seconds", type=float, default=30.0, help="0 skips the VAD CPU run")
    args = p.parse_args()
    if args.paced is None:
        args.paced = TOY_PACING if args.config is None and args.preset == "toy" else []
    return args


def write_bench_preset(args: argparse.Namespace, name: str, options: list[str],
                       sessions: int) -> Path:
    """The chosen preset with room for ``sessions`` calls, the step delays and stage ``options``
    (``STAGE.OPTION=VALUE``)."""
    source = args.config or ROOT / "configs" / f"{args.preset}.yaml"
    data = yaml.safe_load(source.read_text())
    data["max_sessions"] = max(sessions, data.get("max_sessions", 8))
    delays = [d.replace("=", ".step_delay_s=", 1) for d in args.step_delay]
    apply_stage_changes(data["pipeline"], delays + options)
    path = RESULTS_DIR / f"{NAME}_{name}_preset.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@contextmanager
def probed_server(preset: Path, name: str, bench: str = NAME) -> Iterator[tuple[ServerProcess, Path]]:
    """``duplex.serve`` under the probe, stopped with SIGINT as a user would; and the probe file
    (both files named after the benchmark ``bench`` and the server ``name``)."""
    port = free_port()
    log_path = RESULTS_DIR / f"{bench}_{name}_server.log"
    probe_path = RESULTS_DIR / f"{bench}_{name}_probe.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "evaluation.server_probe", str(probe_path),
             "--config", str(preset), "--port", str(port), "--ice-host", "127.0.0.1"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_healthy(server)
        yield server, probe_path
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)


async def latency_phases(server: ServerProcess, args: argparse.Namespace) -> tuple[Any, ...]:
    async with Phase(server) as idle:
        await asyncio.sleep(IDLE_SECONDS)  # measuring CPU over a span of wall time
    async with Phase(server) as turns:
        call = await calls.latency_turns(server, args.turns)
    return idle, turns, call


async def load_phases(server: ServerProcess, args: argparse.Namespace,
                      levels: list[int]) -> tuple[Any, ...]:
    async with Phase(server) as barge:
        call, records = await calls.barge_ins(server, args.barge_ins)
    ramp = []
    for level in levels:
        async with Phase(server) as phase:
            ramp.append((phase, await calls.concurrent_calls(server, level, args.ramp_turns)))
    return barge, call, records, ramp


def vad_cpu(seconds: float) -> dict[str, Any] | None:
    if seconds <= 0:
        return None
    out = subprocess.run(
        [sys.executable, "-m", "evaluation.vad_cpu", "--seconds", str(seconds)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    return json.loads(out)


def main() -> None:
    run_in_loopback_namespace("evaluation.duplex_bench")
    args = parse_args()
    levels = [int(n) for n in args.sessions.split(",")]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": " ".join(["python -m evaluation.duplex_bench", *sys.argv[1:]]),
        "preset": str(args.config or args.preset), "step_delays": args.step_delay,
        "paced": args.paced, "loadavg_start": [round(v, 2) for v in os.getloadavg()],
    }
    plain = write_bench_preset(args, "a", [], 1)
    config = load_preset(["--config", str(plain)]).pipeline
    with probed_server(plain, "a") as (server, probe_path):
        idle, turns, call = asyncio.run(latency_phases(server, args))
    result.update(report.analyse_latency(Probe.load(probe_path), idle, turns, call, config))
    paced = write_bench_preset(args, "b", args.paced, max(levels))
    with probed_server(paced, "b") as (server, probe_path):
        barge, call, records, ramp = asyncio.run(load_phases(server, args, levels))
    probe = Probe.load(probe_path)
    result["barge_in"] = report.analyse_barge_ins(probe, barge, call, records)
    result["ramp"] = [report.analyse_level(probe, phase, level) for phase, level in ramp]
    result["sustained_calls"] = report.sustained_calls(result["ramp"])
    result["vad"] = vad_cpu(args.vad_seconds)
    print(report.tables(result))
    png = plot(result, RESULTS_DIR / f"{NAME}.png")
    for level in result["ramp"]:  # the raw gaps went into the plot; the summaries stay
        del level["server_gaps_s"], level["client_gaps_s"]
    print(f"\n{write_json(NAME, result)}\n{png}")


if __name__ == "__main__":
    main()
