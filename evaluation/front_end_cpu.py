"""What echo cancellation and noise suppression add per WebRTC call, against a bare aiortc peer.

The calls of ``evaluation.call_cpu`` (espeak-ng speech and pauses in a loop, the ``toy`` preset
answering with tones) talk to one ``python -m duplex.serve``; each call first sets its audio front
end with ``session.update`` (``audio.input``), so that every setting runs on the same server in the
same run, in turn with a bare aiortc peer per call (aiortc's own floor):

- ``off``: neither (WebRTC's default: browsers cancel their own echo);
- ``echo``: ``echo_cancellation: true`` (AEC3; SIP, Twilio and the WebSocket's default);
- ``near_field``: ``noise_reduction: {"type": "near_field"}`` (WebRTC's suppressor and the talk gate);
- ``echo + near_field``: both.

CPU of the server's main process (where the front end runs) per call, median over rounds; what
each setting adds over ``off``, also as a share of the bare peer.

    python -m evaluation.front_end_cpu [--seconds 15] [--rounds 3] [--calls 1 4]

Writes ``evaluation/results/front_end_cpu.json`` and ``front_end_cpu.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections import defaultdict
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import numpy as np

from evaluation.bare_peer import bare_peers
from evaluation.bench_common import (
    ROOT,
    format_table,
    machine,
    run_in_loopback_namespace,
    save_figure,
    save_results,
)
from evaluation.call_cpu import QUESTION, measure_bare, measure_server, server
from harness.speech import speech

SETTINGS: dict[str, dict[str, Any]] = {
    "off": {"echo_cancellation": False, "noise_reduction": None},
    "echo": {"echo_cancellation": True, "noise_reduction": None},
    "near_field": {"echo_cancellation": False, "noise_reduction": {"type": "near_field"}},
    "echo + near_field": {"echo_cancellation": True, "noise_reduction": {"type": "near_field"}},
}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    question = speech(QUESTION, 48000, 0.2, 0.2)
    per_call: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    with tempfile.TemporaryDirectory(prefix="front-end-cpu-") as tmp_name:
        async with AsyncExitStack() as stack:
            peers = await stack.enter_async_context(bare_peers())
            target = await stack.enter_async_context(server(ROOT, Path(tmp_name)))
            for round_ in range(args.rounds):
                for calls in args.calls:
                    bare = await measure_bare(peers, calls, args.seconds, question)
                    per_call["bare"][calls].append(100 * bare["main_cores"] / calls)
                    for name, audio_input in SETTINGS.items():
                        window = await measure_server(target, calls, args.seconds, question, audio_input)
                        per_call[name][calls].append(100 * window["main_cores"] / calls)
                    print(f"round {round_ + 1}, {calls} calls: " + ", ".join(
                        f"{n} {v[calls][-1]:.2f}%" for n, v in per_call.items()), flush=True)
    levels = []
    for calls in args.calls:
        median = {n: round(float(np.median(v[calls])), 2) for n, v in per_call.items()}
        level: dict[str, Any] = {"calls": calls, "percent_of_a_core_per_call": median,
                                 "rounds": {n: v[calls] for n, v in per_call.items()}}
        level["added_over_off"] = {n: round(median[n] - median["off"], 2) for n in SETTINGS if n != "off"}
        level["added_share_of_bare"] = {n: round(added / max(median["bare"], 1e-9), 3)
                                        for n, added in level["added_over_off"].items()}
        levels.append(level)
    return {"machine": machine(), "seconds": args.seconds, "rounds": args.rounds,
            "settings": SETTINGS, "levels": levels}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["bare", *SETTINGS]
    fig, ax = plt.subplots(figsize=(8, 5))
    x = np.arange(len(result["levels"]))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [lv["percent_of_a_core_per_call"][name] for lv in result["levels"]]
        ax.bar(x + i * width, values, width, label="bare aiortc peer" if name == "bare" else f"duplex, {name}")
    ax.set_xticks(x + width * (len(names) - 1) / 2, [str(lv["calls"]) for lv in result["levels"]])
    ax.set_xlabel("concurrent calls")
    ax.set_ylabel("% of a core per call (main process, median)")
    ax.set_title("Audio front end: CPU per WebRTC call")
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=100)


def _print(result: dict[str, Any]) -> None:
    names = ["bare", *SETTINGS]
    rows = [[lv["calls"], *(lv["percent_of_a_core_per_call"][n] for n in names)] for lv in result["levels"]]
    print("\n% of a core per call (median over rounds)")
    print(format_table(["calls", *names], rows))
    rows = [[lv["calls"], *(f"+{lv['added_over_off'][n]} ({100 * lv['added_share_of_bare'][n]:.0f}% of bare)"
                            for n in SETTINGS if n != "off")] for lv in result["levels"]]
    print("\nadded over off")
    print(format_table(["calls", *(n for n in SETTINGS if n != "off")], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.front_end_cpu")
    result = asyncio.run(run(args))
    _print(result)
    save_results("front_end_cpu", result, plot)


if __name__ == "__main__":
    main()
