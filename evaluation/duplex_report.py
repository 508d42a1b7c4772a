"""The duplex benchmark's measurement windows and its report: from what a phase collected (probe
records, /metrics scrapes, CPU samples, what the clients saw) to the numbers, budgets and tables.

A :class:`Phase` lives for one phase of a run; the report dicts it feeds are plain JSON data.
"""

from __future__ import annotations

import math
from typing import Any

from evaluation import duplex_analysis as analysis
from evaluation.bench_common import format_table, summarize
from evaluation.duplex_calls import scrape_metrics
from evaluation.proc_cpu import CpuSample
from harness.server import ServerProcess
from pipeline.config import PipelineConfig

PACING_BUDGET_MS = 25.0
STOP_BUDGET_MS = 100.0
ABORT_BUDGET_MS = 20.0
OVERHEAD_BUDGET_MS = 15.0
VAD_BUDGET_PERCENT = 1.0


class Phase:
    """/metrics scrapes and CPU samples of the server's process tree around one phase."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server

    async def __aenter__(self) -> Phase:
        self.metrics_before = await scrape_metrics(self.server.url)
        self.cpu_before = CpuSample.take(self.server.process.pid)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cpu_after = CpuSample.take(self.server.process.pid)
        self.metrics_after = await scrape_metrics(self.server.url)

    @property
    def start(self) -> float:
        return self.cpu_before.wall

    @property
    def end(self) -> float:
        return self.cpu_after.wall

    def cpu(self) -> dict[str, float]:
        return CpuSample.usage(self.cpu_before, self.cpu_after)

    def step_means(self, config: PipelineConfig, terminal: str) -> dict[str, float]:
        """Mean step seconds of each stage on the path to the first audio chunk: model compute."""
        return analysis.path_compute(config, terminal, self.metrics_before, self.metrics_after)


def _ms(values: list[float]) -> dict[str, Any]:
    return summarize(v for v in values if not math.isnan(v))


def _terminal(probe: analysis.Probe, config: PipelineConfig) -> str:
    """The stage whose chunks carried the first audio (the audio terminal)."""
    return next(iter({stage for _, stage in probe.first_audio.values()}), config.entry)


def analyse_latency(probe: analysis.Probe, idle: Phase, turns: Phase, call: Any,
                    config: PipelineConfig) -> dict[str, Any]:
    """Voice-to-voice and its parts, from the turns phase (``call``: its ClientCall)."""
    steps = turns.step_means(config, _terminal(probe, config))
    rows = analysis.turn_breakdown(probe, {call.call_id}, sum(steps.values()))
    client = analysis.client_turns([call], rows)
    parts = [k for k in rows[0] if k not in ("call", "decision")]
    metric = analysis.mean_delta(turns.metrics_before, turns.metrics_after,
                                 "duplex_voice_to_voice_seconds")
    return {
        "idle_cpu": idle.cpu(),
        "turns": {
            "cpu": turns.cpu(),
            "audio_path_step_ms": {s: round(v * 1000, 2) for s, v in steps.items()},
            "voice_to_voice_metric_mean_ms": round(1000 * metric, 2),
            **{k: _ms([r[k] for r in rows]) for k in parts},
            **{k: _ms([r[k] for r in client]) for k in client[0]},
            "per_turn_ms": [{k: round(r[k] * 1000, 2) for k in parts} for r in rows],
        },
    }


def analyse_barge_ins(probe: analysis.Probe, phase: Phase, call: Any,
                      records: list[dict[str, Any]]) -> dict[str, Any]:
    rows = analysis.barge_in_rows(probe, call.call_id, records)
    parts = [k for k in rows[0] if k != "status"]
    return {
        "cpu": phase.cpu(),
        "statuses": [r["status"] for r in rows],
        **{k: _ms([r[k] for r in rows]) for k in parts},
        "onset_to_silent_frame": _ms([r["onset_to_pause"] + r["pause_to_silent_frame"]
                                      for r in rows]),
        "per_event_ms": [{k: round(r[k] * 1000, 2) for k in parts} for r in rows],
    }


def analyse_level(probe: analysis.Probe, phase: Phase, calls: list[Any]) -> dict[str, Any]:
    """One ramp level: pacing and underruns at the server and the clients, latency, CPU."""
    tracks = [probe.track_of[c.call_id] for c in calls]
    gaps, underruns = analysis.server_pacing(probe, tracks, phase.start, phase.end)
    client_gaps, client_underruns, missing = analysis.client_pacing(calls)
    # Model compute is not subtracted here: on a paced server a request also waits for the batch
    # step in progress, which is the model's scheduling, not the framework's overhead.
    rows = analysis.turn_breakdown(probe, {c.call_id for c in calls}, 0.0)
    cpu = phase.cpu()
    server_gaps = summarize(gaps)
    return {
        "sessions": len(calls), "cpu": cpu,
        "server_cpu_percent_per_session": round(100 * cpu["server_cores"] / len(calls), 1),
        "server_gap_ms": server_gaps, "client_gap_ms": summarize(client_gaps),
        "server_underrun_frames": underruns, "client_underrun_frames": client_underruns,
        "client_missing_frames": missing,
        "voice_to_voice_ms": _ms([r["voice_to_voice"] for r in rows]),
        "pipeline_ttfa_ms": _ms([r["pipeline_ttfa"] for r in rows]),
        # The verdict is the server's: the clients share this machine, and their own lateness
        # (a busy benchmark process) shows in the client columns, not in what the server sent.
        "sustained": underruns == 0 and server_gaps["p99"] is not None
        and server_gaps["p99"] <= PACING_BUDGET_MS,
        "server_gaps_s": gaps, "client_gaps_s": client_gaps,
    }


def sustained_calls(ramp: list[dict[str, Any]]) -> int:
    """The largest level sustained together with every smaller one (0 if none)."""
    best = 0
    for level in sorted(ramp, key=lambda r: r["sessions"]):
        if not level["sustained"]:
            break
        best = level["sessions"]
    return best


def _p(summary: dict[str, Any]) -> tuple[Any, Any, Any]:
    return summary["p50"], summary["p99"], summary["n"]


def _verdict(value: float | None, budget: float) -> str:
    return "-" if value is None else ("met" if value <= budget else "MISSED")


def _latency_rows(t: dict[str, Any], b: dict[str, Any]) -> list[tuple[Any, ...]]:
    overhead = t["framework_overhead"]
    steps = t["audio_path_step_ms"]
    return [
        ("end-of-turn wait: speech end sent -> decision", *_p(t["end_of_turn_wait"]),
         "silence_duration + rx buffer + VAD", ""),
        ("pipeline: submit -> first audio chunk", *_p(t["pipeline_ttfa"]), "", ""),
        ("  model compute on that path (mean steps)", round(sum(steps.values()), 2), None, None,
         " + ".join(f"{k} {v}" for k, v in steps.items()), ""),
        ("framework overhead", *_p(overhead), f"<= {OVERHEAD_BUDGET_MS:.0f}",
         f"p50 {_verdict(overhead['p50'], OVERHEAD_BUDGET_MS)}, "
         f"p99 {_verdict(overhead['p99'], OVERHEAD_BUDGET_MS)}"),
        ("  session: decision -> submit", *_p(t["to_submit"]), "", ""),
        ("  pipeline: first audio chunk - compute", *_p(t["pipeline_overhead"]),
         "IPC, queues, batching", ""),
        ("  session: first chunk -> track enqueue", *_p(t["to_enqueue"]), "", ""),
        ("wait for the 20 ms tick (not counted)", *_p(t["tick_wait"]), "", ""),
        ("voice-to-voice at the server: decision -> frame", *_p(t["voice_to_voice"]),
         f"metric mean {t['voice_to_voice_metric_mean_ms']}", ""),
        ("voice-to-voice at the client: speech end -> heard", *_p(t["client_voice_to_voice"]),
         "", ""),
        ("barge-in: onset audio arrives -> paused (metric)", *_p(b["onset_to_pause"]),
         "includes the VAD's delay", ""),
        ("barge-in: onset audio arrives -> silent frame out", *_p(b["onset_to_silent_frame"]),
         f"<= {STOP_BUDGET_MS:.0f}", _verdict(b["onset_to_silent_frame"]["p99"], STOP_BUDGET_MS)),
        ("barge-in: speech sent -> paused at the server", *_p(b["sent_to_pause"]),
         "+ rx buffer", ""),
        ("barge-in: speech sent -> silence at the client", *_p(b["sent_to_client_silence"]),
         "+ both ways", ""),
        ("abort -> all stages clear", *_p(b["abort_to_clear"]), f"<= {ABORT_BUDGET_MS:.0f} p99",
         _verdict(b["abort_to_clear"]["p99"], ABORT_BUDGET_MS)),
    ]


def _ramp_row(r: dict[str, Any]) -> tuple[Any, ...]:
    cpu = r["cpu"]
    return (
        r["sessions"], *_p(r["server_gap_ms"])[:2], *_p(r["client_gap_ms"])[:2],
        r["server_underrun_frames"], f"{r['client_underrun_frames']}/{r['client_missing_frames']}",
        *_p(r["voice_to_voice_ms"])[:2], r["pipeline_ttfa_ms"]["p50"],
        cpu["server_main_cores"], cpu["stage_process_cores"], r["server_cpu_percent_per_session"],
        cpu["client_cores"], cpu["other_cores"], "yes" if r["sustained"] else "NO",
    )


def tables(result: dict[str, Any]) -> str:
    rows = _latency_rows(result["turns"], result["barge_in"])
    vad = result.get("vad")
    if vad is not None:
        percent = vad["vad_cpu_percent_of_one_core"]
        rows.append(("VAD CPU, % of one core per session", percent, None, None,
                     f"<= {VAD_BUDGET_PERCENT:.0f}", _verdict(percent, VAD_BUDGET_PERCENT)))
    latency = format_table(("measure (ms)", "p50", "p99", "n", "budget / note", "verdict"), rows)
    ramp = format_table(
        ("calls", "gap p50", "gap p99", "client p50", "client p99", "underruns",
         "client silent/lost", "v2v p50", "v2v p99", "ttfa p50", "server", "stages", "%core/call",
         "clients", "others", "sustained"),
        [_ramp_row(r) for r in result["ramp"]],
    )
    load = ", ".join(f"{name} {result[key]['cpu']['other_cores']}"
                     for name, key in (("turns", "turns"), ("barge-ins", "barge_in")))
    return (
        f"{latency}\n\nramp on the paced server (ms; cores busy on average; underruns = silent "
        f"frames inside answers; sustained = no underrun and server gap p99 <= "
        f"{PACING_BUDGET_MS:.0f} ms):\n{ramp}\n"
        f"sustained with no underrun: {result['sustained_calls']} concurrent calls\n\n"
        f"idle server: {result['idle_cpu']['server_cores']} cores. Other programs on this machine, "
        f"cores busy: {load}; load average at start {result['loadavg_start']}"
    )
