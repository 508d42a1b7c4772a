"""CPU per WebRTC call: the server's main process and its stage processes, beside a bare aiortc peer.

Every client talks and pauses in a loop (espeak-ng speech, then silence; the ``toy`` preset answers
with tones, so the agent sometimes speaks and is sometimes interrupted). At each load (1, 4, 8
calls) and in each round the same clients call, one after the other:

- ``server``: ``python -m duplex.serve`` on the toy preset from this checkout;
- ``baseline`` (with ``--baseline-root DIR``): the same from another checkout, e.g. the code
  before a change, measured in the same run so that a busy machine slows both alike;
- ``bare``: a bare aiortc peer per call in a process of its own (``evaluation.bare_peer``):
  ``RTCPeerConnection``, aiortc's own silence track (its encoder, its audio-level loop), the
  inbound track read and dropped. That is aiortc's own floor for one call.

CPU comes from /proc (``evaluation.proc_cpu``): per call, of the server's main process (and of its
main thread and of its other threads: aiortc's decoder threads, which only wait since the server
decodes on its loop, and any executor), of the stage processes, and of the bare peer process. The
server's own metrics over the window give pacing (outbound frame gaps), underruns and barge-in
stop; ``frames`` counts the gaps observed.

Then, where the main thread's time goes: each server runs once more at one call under a thread-CPU
profiler (``evaluation.thread_profile``), switched on and off by signals around the same window,
and its time is broken down by category, scaled to the main thread's unprofiled CPU at one call.

    python -m evaluation.call_cpu [--seconds 15] [--rounds 2] [--calls 1 4 8] [--baseline-root DIR]

Writes ``evaluation/results/call_cpu.json`` and ``call_cpu.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from evaluation.bare_peer import BarePeers, bare_peers
from evaluation.bench_common import (
    ROOT,
    format_table,
    machine,
    run_in_loopback_namespace,
    save_figure,
    save_results,
)
from evaluation.proc_cpu import CpuSample
from evaluation.thread_profile import PROFILED_SERVE, breakdown
from harness.calls import Call, hang_up, open_call
from harness.mic import ScriptedMic
from harness.peers import ClientPeer
from harness.server import ServerProcess, free_port, write_preset
from harness.speech import speech

QUESTION = "Could you tell me what the weather will be like tomorrow?"
# Silence between two questions: the toy's answer (~1.5 s of tones) starts ~0.6 s into it, so
# most questions talk over the end of the previous answer (a barge-in) and some come after it.
PAUSE_S = 1.0
WARMUP_S = 2.0  # after the calls are up, before the window opens
STARTUP_TIMEOUT_S = 120.0


# --- servers ---------------------------------------------------------------------------------


@asynccontextmanager
async def server(root: Path, tmp: Path, profile: Path | None = None) -> AsyncIterator[ServerProcess]:
    """``duplex.serve`` (toy preset) from checkout ``root``; under the profiler with ``profile``."""
    preset = write_preset(tmp / f"toy-{free_port()}.yaml", "toy")
    port = free_port()
    args = ["--config", str(preset), "--port", str(port), "--ice-host", "127.0.0.1"]
    command = ([sys.executable, "-c", PROFILED_SERVE, str(profile), *args] if profile
               else [sys.executable, "-m", "duplex.serve", *args])
    log_path = tmp / f"server-{port}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(root))
    with log_path.open("wb") as log:  # Popen only starts it; nothing below blocks the loop on it
        process = subprocess.Popen(  # noqa: ASYNC220 - harness.ServerProcess holds a Popen
            command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    started = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        await _healthy(started)
        yield started
    finally:
        process.send_signal(signal.SIGINT)
        try:
            await asyncio.to_thread(process.wait, 30)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)


async def _healthy(started: ServerProcess) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if started.process.poll() is not None:
                raise RuntimeError(f"server exited:\n{started.log()}")
            try:
                if (await http.get(f"{started.url}/healthz", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)  # polling another process's readiness
    raise RuntimeError(f"server not healthy:\n{started.log()}")


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(("duplex_outbound_frame_gap", "duplex_outbound_underruns",
                                  "duplex_barge_in_stop", "duplex_barge_ins")):
                samples[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    return samples


def _media_quality(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Pacing, underruns and barge-in stop over a window, from the metrics' differences."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def get(name: str, labels: dict[str, str] | None = None) -> float:
        return delta.get(name + json.dumps(labels or {}, sort_keys=True), 0.0)

    gaps = get("duplex_outbound_frame_gap_seconds_count")
    buckets = sorted((float(json.loads(k[k.index("{"):])["le"]), v) for k, v in delta.items()
                     if k.startswith("duplex_outbound_frame_gap_seconds_bucket"))
    p99 = next((le for le, count in buckets if gaps and count >= 0.99 * gaps), None)
    stops = get("duplex_barge_in_stop_seconds_count")
    return {
        "frames": int(gaps),
        "frame_gap_mean_ms": round(1000 * get("duplex_outbound_frame_gap_seconds_sum") / gaps, 2)
        if gaps else None,
        "frame_gap_p99_bucket_ms": None if p99 is None else round(1000 * p99, 1),
        "underruns": int(get("duplex_outbound_underruns_total")),
        "barge_in_stops": int(stops),
        "barge_in_stop_mean_ms": round(1000 * get("duplex_barge_in_stop_seconds_sum") / stops, 1)
        if stops else None,
    }


# --- threads of a process --------------------------------------------------------------------


def _threads(pid: int) -> dict[int, float]:
    """CPU seconds per thread id of ``pid``."""
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def _thread_split(pid: int, before: dict[int, float], after: dict[int, float]) -> tuple[float, float]:
    """CPU seconds of the main thread and of all other threads between two readings."""
    main = after.get(pid, 0.0) - before.get(pid, 0.0)
    others = sum(v - before.get(t, 0.0) for t, v in after.items() if t != pid)
    return main, others


# --- the clients -----------------------------------------------------------------------------


async def _talk(mic: ScriptedMic, question: np.ndarray) -> None:
    while True:
        await mic.say(question)
        await asyncio.sleep(PAUSE_S)  # the pause is the scenario: a person between questions


async def _window(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Cores busy per process (and the first one's main thread and other threads) over a window."""
    main_pid = next(iter(pids.values()))
    threads_before = _threads(main_pid)
    before = {name: CpuSample.take(pid) for name, pid in pids.items()}
    await asyncio.sleep(seconds)  # the measuring window itself
    after = {name: CpuSample.take(pid) for name, pid in pids.items()}
    threads_after = _threads(main_pid)
    usage = {name: CpuSample.usage(before[name], after[name]) for name in pids}
    wall = usage[next(iter(pids))]["seconds"]
    main_thread, other_threads = _thread_split(main_pid, threads_before, threads_after)
    return {
        "seconds": wall,
        "main_cores": usage[next(iter(pids))]["server_main_cores"],
        "main_thread_cores": round(main_thread / wall, 3),
        "other_threads_cores": round(other_threads / wall, 3),
        "stage_cores": usage[next(iter(pids))]["stage_process_cores"],
        "client_cores": usage[next(iter(pids))]["client_cores"],
        "machine_cores": usage[next(iter(pids))]["machine_cores"],
    }


async def measure_server(target: ServerProcess, calls: int, seconds: float, question: np.ndarray,
                         audio_input: dict[str, Any] | None = None) -> dict[str, Any]:
    """``calls`` calls talking to ``target`` for ``seconds``; each first sets ``audio_input``
    (``session.update``'s ``audio.input`` fields: echo cancellation, noise reduction) if given."""
    opened: list[Call] = [await open_call(target) for _ in range(calls)]
    for call in opened if audio_input is not None else []:
        call.peer.send({"type": "session.update",
                        "session": {"type": "realtime", "audio": {"input": audio_input}}})
        await call.wait_event("session.updated")
    talkers = [asyncio.create_task(_talk(c.mic, question)) for c in opened]  # type: ignore[arg-type]
    try:
        await asyncio.sleep(WARMUP_S)
        metrics_before = _metrics(target.url)
        window = await _window({"server": target.process.pid}, seconds)
        window["media"] = _media_quality(metrics_before, _metrics(target.url))
    finally:
        for t in talkers:
            t.cancel()
        for c in opened:
            await hang_up(target, c)
    return window


async def measure_bare(peers: BarePeers, calls: int, seconds: float,
                       question: np.ndarray) -> dict[str, Any]:
    clients, talkers = [], []
    for _ in range(calls):
        mic = ScriptedMic()
        client = ClientPeer(mic)
        await client.connect(peers)  # type: ignore[arg-type]  # duck-typed: only answer()
        clients.append(client)
        talkers.append(asyncio.create_task(_talk(mic, question)))
    try:
        await asyncio.sleep(WARMUP_S)
        return await _window({"bare": peers.pid}, seconds)
    finally:
        for t in talkers:
            t.cancel()
        for c in clients:
            await c.close()


# --- the profile -----------------------------------------------------------------------------


async def profile_one_call(root: Path, tmp: Path, seconds: float, question: np.ndarray,
                           main_thread_percent: float) -> dict[str, Any]:
    stats_path = tmp / f"profile-{free_port()}.prof"
    async with server(root, tmp, profile=stats_path) as target:
        call = await open_call(target)
        talker = asyncio.create_task(_talk(call.mic, question))  # type: ignore[arg-type]
        try:
            await asyncio.sleep(WARMUP_S)
            target.process.send_signal(signal.SIGUSR1)
            await asyncio.sleep(seconds)  # the profiled window
            target.process.send_signal(signal.SIGUSR2)
            while not stats_path.exists():
                await asyncio.sleep(0.1)  # written by the server process on the signal
        finally:
            talker.cancel()
            await hang_up(target, call)
    return breakdown(stats_path, main_thread_percent)


# --- the run ---------------------------------------------------------------------------------


def _per_call(samples: list[dict[str, Any]], key: str, calls: int) -> dict[str, float]:
    values = [100 * s[key] / calls for s in samples]
    return {"median": round(float(np.median(values)), 2), "min": round(min(values), 2),
            "max": round(max(values), 2)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    question = speech(QUESTION, 48000, 0.2, 0.2)
    roots = {"server": ROOT}
    if args.baseline_root:
        roots["baseline"] = Path(args.baseline_root).resolve()
    raw: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    with tempfile.TemporaryDirectory(prefix="call-cpu-") as tmp_name:
        tmp = Path(tmp_name)
        async with AsyncExitStack() as stack:
            peers = await stack.enter_async_context(bare_peers())
            servers = {name: await stack.enter_async_context(server(root, tmp))
                       for name, root in roots.items()}
            for round_ in range(args.rounds):
                for calls in args.calls:
                    raw["bare"][calls].append(await measure_bare(peers, calls, args.seconds, question))
                    for name, target in servers.items():
                        raw[name][calls].append(
                            await measure_server(target, calls, args.seconds, question))
                    print(f"round {round_ + 1}, {calls} calls: " + ", ".join(
                        f"{n} {100 * raw[n][calls][-1]['main_cores'] / calls:.1f}%/call"
                        for n in raw), flush=True)
            # A paced track that fell more than MAX_LAG_SECONDS behind logs it and restarts.
            restarts = {name: target.log().count("behind schedule") for name, target in servers.items()}
        profiles = {}
        for name, root in (roots.items() if args.profile else []):
            one = [sample["main_thread_cores"] for sample in raw[name][min(args.calls)]]
            profiles[name] = await profile_one_call(root, tmp, args.seconds, question,
                                                    100 * float(np.median(one)) / min(args.calls))
    levels = []
    for calls in args.calls:
        level: dict[str, Any] = {"calls": calls,
                                 "bare_peer_per_call": _per_call(raw["bare"][calls], "main_cores", calls)}
        for name in roots:
            samples = raw[name][calls]
            level[name] = {
                "main_process_per_call": _per_call(samples, "main_cores", calls),
                "main_thread_per_call": _per_call(samples, "main_thread_cores", calls),
                "other_threads_per_call": _per_call(samples, "other_threads_cores", calls),
                "stage_processes_per_call": _per_call(samples, "stage_cores", calls),
                "media": [s["media"] for s in samples],
            }
            level[name]["ratio_to_bare"] = round(
                level[name]["main_process_per_call"]["median"]
                / max(level["bare_peer_per_call"]["median"], 1e-9), 2)
        levels.append(level)
    return {"machine": machine(), "seconds": args.seconds, "rounds": args.rounds,
            "roots": {k: str(v) for k, v in roots.items()}, "levels": levels,
            "outbound_schedule_restarts": restarts,
            "profile_one_call": profiles,
            "raw": {n: {str(c): v for c, v in per.items()} for n, per in raw.items()}}


_COLOURS = {"bare": "#999999", "server": "#1f77b4", "baseline": "#ff7f0e"}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("baseline", "server") if n in result["levels"][0]]
    profiles = result["profile_one_call"]
    fig, axes = plt.subplots(1, 2 if profiles else 1, figsize=(14 if profiles else 7, 5.5),
                             squeeze=False)
    left = axes[0][0]
    x = np.arange(len(result["levels"]))
    width = 0.8 / (1 + 2 * len(names))
    bars = [("bare", "bare aiortc peer", lambda lv: lv["bare_peer_per_call"])]
    for n in names:
        bars.append((n, f"{n}: main process", lambda lv, n=n: lv[n]["main_process_per_call"]))
        bars.append((n, f"{n}: stage processes", lambda lv, n=n: lv[n]["stage_processes_per_call"]))
    for i, (kind, label, get) in enumerate(bars):
        med = [get(lv)["median"] for lv in result["levels"]]
        low = [get(lv)["median"] - get(lv)["min"] for lv in result["levels"]]
        high = [get(lv)["max"] - get(lv)["median"] for lv in result["levels"]]
        left.bar(x + i * width, med, width, yerr=[low, high], label=label, color=_COLOURS[kind],
                 alpha=1.0 if "stage" not in label else 0.45, capsize=3)
    left.set_xticks(x + width * (len(bars) - 1) / 2, [str(lv["calls"]) for lv in result["levels"]])
    left.set_xlabel("concurrent calls")
    left.set_ylabel("% of a core per call (median, range over rounds)")
    left.set_title("CPU per call")
    left.legend(fontsize=8)

    if profiles:
        _plot_profiles(axes[0][1], profiles)
    save_figure(fig, path, dpi=100)


def _plot_profiles(right: Any, profiles: dict[str, Any]) -> None:
    cats = sorted({c for p in profiles.values()
                   for c in p["categories_percent_of_a_core"]},
                  key=lambda c: -max(p["categories_percent_of_a_core"].get(c, 0)
                                     for p in profiles.values()))
    y = np.arange(len(cats))
    for i, (name, prof) in enumerate(profiles.items()):
        values = [prof["categories_percent_of_a_core"].get(c, 0.0) for c in cats]
        right.barh(y + i * 0.4, values, 0.4, label=name, color=_COLOURS[name])
    right.set_yticks(y + 0.2, cats, fontsize=8)
    right.invert_yaxis()
    right.set_xlabel("% of a core (main thread, one call)")
    right.set_title("where the main thread's time goes")
    right.legend(fontsize=8)


def _print(result: dict[str, Any]) -> None:
    names = [n for n in ("server", "baseline") if n in result["levels"][0]]
    headers = ["calls", "bare peer"]
    for n in names:
        headers += [f"{n} main", f"{n} main thread", f"{n} other threads", f"{n} stages", "× bare"]
    rows = []
    for lv in result["levels"]:
        row: list[Any] = [lv["calls"], _fmt(lv["bare_peer_per_call"])]
        for n in names:
            row += [_fmt(lv[n]["main_process_per_call"]), _fmt(lv[n]["main_thread_per_call"]),
                    _fmt(lv[n]["other_threads_per_call"]), _fmt(lv[n]["stage_processes_per_call"]),
                    lv[n]["ratio_to_bare"]]
        rows.append(row)
    print("\n% of a core per call: median [min-max] over rounds")
    print(format_table(headers, rows))
    for lv in result["levels"]:
        for n in names:
            print(f"{lv['calls']} calls, {n} media: {lv[n]['media']}")
    print(f"outbound schedule restarts in the server logs: {result['outbound_schedule_restarts']}")
    for name, prof in result["profile_one_call"].items():
        print(f"\n{name}: main thread at one call, by category (% of a core)")
        print(format_table(["category", "%"], list(prof["categories_percent_of_a_core"].items())))


def _fmt(spread: dict[str, float]) -> str:
    return f"{spread['median']} [{spread['min']}-{spread['max']}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--baseline-root", help="another checkout to measure beside this one")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the profiled runs")
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.call_cpu")
    result = asyncio.run(run(args))
    _print(result)
    save_results("call_cpu", result, plot)


if __name__ == "__main__":
    main()
