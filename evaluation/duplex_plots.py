"""The duplex benchmark's figure (matplotlib, Agg): one PNG, four panels.

(a) voice-to-voice at the server per turn, stacked by part; (b) barge-in and abort latencies;
(c) distribution of outbound frame gaps per ramp level, server and client; (d) CPU and pacing p99
against concurrent calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend is chosen first
import numpy as np  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402

from evaluation.bench_common import save_figure

PARTS = ("to_submit", "model_compute", "pipeline_overhead", "to_enqueue", "tick_wait")
BARGE = ("onset_to_pause", "pause_to_silent_frame", "sent_to_pause", "sent_to_client_silence",
         "abort_to_clear")


def plot(result: dict[str, Any], path: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    _turns(axes[0][0], result["turns"]["per_turn_ms"])
    _barge(axes[0][1], result["barge_in"]["per_event_ms"])
    _gaps(axes[1][0], result["ramp"])
    _ramp(axes[1][1], result["ramp"])
    fig.suptitle(f"duplex session server, preset {result['preset']}", fontsize=12)
    save_figure(fig, path, dpi=100)
    return path


def _turns(ax: Any, turns: list[dict[str, float]]) -> None:
    bottom = np.zeros(len(turns))
    turns = [dict(t, model_compute=t["pipeline_ttfa"] - t["pipeline_overhead"]) for t in turns]
    for part in PARTS:
        values = np.array([t[part] for t in turns])
        ax.bar(range(1, len(turns) + 1), values, bottom=bottom, label=part)
        bottom += values
    ax.set(title="(a) voice-to-voice at the server, per turn", xlabel="turn", ylabel="ms")
    ax.set_xticks(range(1, len(turns) + 1))
    ax.legend(fontsize=8)


def _barge(ax: Any, events: list[dict[str, Any]]) -> None:
    for i, name in enumerate(BARGE):
        values = [e[name] for e in events if not np.isnan(e[name])]
        ax.scatter(np.full(len(values), i) + np.linspace(-0.15, 0.15, len(values)), values, s=14)
    ax.set_xticks(range(len(BARGE)), [n.replace("_", "\n") for n in BARGE], fontsize=8)
    ax.set_yscale("log")
    ax.axhline(100, color="red", lw=0.8, ls="--", label="stop budget 100 ms")
    ax.axhline(20, color="orange", lw=0.8, ls="--", label="abort budget 20 ms")
    ax.set(title="(b) barge-in and abort, per interruption", ylabel="ms (log)")
    ax.legend(fontsize=8)


def _gaps(ax: Any, ramp: list[dict[str, Any]]) -> None:
    for level in ramp:
        for key, style in (("server_gaps_s", "-"), ("client_gaps_s", ":")):
            gaps = np.sort(np.asarray(level[key]) * 1000)
            if gaps.size:
                tail = 1 - np.arange(gaps.size) / gaps.size
                side = "server" if key.startswith("server") else "client"
                ax.step(gaps, tail, style, where="post", label=f"{level['sessions']} {side}")
    ax.axvline(25, color="red", lw=0.8, ls="--")
    ax.set(title="(c) frame gaps: fraction of gaps longer than x", xlabel="gap (ms)", yscale="log",
           xlim=(0, 60))
    ax.legend(fontsize=7, ncol=2, title="sessions", title_fontsize=8)


def _ramp(ax: Any, ramp: list[dict[str, Any]]) -> None:
    sessions = [r["sessions"] for r in ramp]
    for key, style, label in (("server_main_cores", "o-", "server process"),
                              ("stage_process_cores", "v-", "stage processes"),
                              ("client_cores", "s-", "benchmark clients"),
                              ("other_cores", "^:", "other programs")):
        ax.plot(sessions, [r["cpu"][key] for r in ramp], style, label=label)
    ax.set(title="(d) load ramp", xlabel="concurrent calls", ylabel="cores busy")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sessions, [str(s) for s in sessions])
    ax.xaxis.set_minor_locator(NullLocator())
    right = ax.twinx()
    p99 = [r["server_gap_ms"]["p99"] or 0.0 for r in ramp]
    right.plot(sessions, p99, "d--", color="black", label="pacing p99 (ms)")
    right.axhline(25, color="red", lw=0.8, ls="--")
    right.set_ylabel("pacing p99 (ms)")
    right.set_ylim(0, max([30.0, *p99]) * 1.1)
    for r, y in zip(ramp, p99):
        if r["server_underrun_frames"]:
            right.annotate(f"{r['server_underrun_frames']} underruns", (r["sessions"], y))
    ax.legend(fontsize=8, loc="upper left")
    right.legend(fontsize=8, loc="upper right")
