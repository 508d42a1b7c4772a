"""Turns the server probe's records (evaluation/server_probe.py), /metrics scrapes and what the
clients saw (evaluation/duplex_calls.py) into the benchmark's numbers. Pure functions over data
already collected; times are seconds on the shared monotonic clock.

Definitions (DESIGN.md "Budgets"):

- a turn, at the server: *decision* (``speech_stopped`` sent) → *submit*
  (``Coordinator.stream`` starts) → *first audio* (the coordinator yields the first audio chunk)
  → *enqueue* (its samples reach the outbound track) → *first frame* (the first audible 20 ms
  frame leaves the track). Framework overhead = decision→first frame, minus the wait for the
  pacing tick (enqueue→first frame), minus the model compute on the path to the first audio chunk
  (one mean step of each stage from the entry to the audio terminal, ``pipeline_stage_seconds``);
- an underrun: a silent frame between the first and last audible frame of one answer (the queue ran
  dry while the model was still speaking); pacing: the gap between consecutive frames of a track.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from evaluation.duplex_calls import AUDIBLE, ClientCall
from pipeline.config import PipelineConfig

FRAME_PTS = 960  # samples per 20 ms frame at 48 kHz


def _lists() -> defaultdict[str, list[Any]]:
    return defaultdict(list)


@dataclass
class Probe:
    """The probe file indexed: per call its track and events, per track its frames and controls."""

    track_of: dict[str, str] = field(default_factory=dict)
    events: dict[str, list[tuple[float, str, str | None]]] = field(default_factory=_lists)
    frames: dict[str, list[tuple[float, bool]]] = field(default_factory=_lists)
    controls: dict[str, list[tuple[float, str]]] = field(default_factory=_lists)
    submits: dict[str, float] = field(default_factory=dict)
    first_audio: dict[str, tuple[float, str]] = field(default_factory=dict)
    transcripts: dict[str, tuple[float, str]] = field(default_factory=dict)
    first_text: dict[str, float] = field(default_factory=dict)
    request_of_item: dict[str, str] = field(default_factory=dict)
    enqueues: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> Probe:
        probe = cls()
        for line in path.read_text().splitlines():
            r = json.loads(line)
            match r["k"]:
                case "peer":
                    probe.track_of[r["call"]] = r["track"]
                case "event":
                    probe.events[r["call"]].append((r["t"], r["type"], r["status"]))
                case "frame":
                    probe.frames[r["track"]].append((r["t"], r["audible"]))
                case "pause" | "resume" | "flush":
                    probe.controls[r["track"]].append((r["t"], r["k"]))
                case "submit":
                    probe.submits[r["req"]] = r["t"]
                case "first_audio":
                    probe.first_audio[r["req"]] = (r["t"], r["stage"])
                case "transcript":
                    probe.transcripts[r["req"]] = (r["t"], r["text"])
                case "response":
                    probe.request_of_item[r["item"]] = r["req"]
                case "first_text":
                    probe.first_text[r["req"]] = r["t"]
                case "enqueue":
                    probe.enqueues.append(r)
        return probe

    def first_frame(self, track: str, since: float, audible: bool) -> float | None:
        return next((t for t, a in self.frames[track] if t >= since and a == audible), None)


def audio_path(config: PipelineConfig, terminal: str) -> list[str]:
    """The stages from the entry to ``terminal`` along ``next``/``stream_to`` (shortest path)."""
    edges = {s.name: [*s.stream_to, *s.next] for s in config.stages}
    paths = [[config.entry]]
    while paths:
        path = paths.pop(0)
        if path[-1] == terminal:
            return path
        paths.extend([*path, n] for n in edges[path[-1]] if n not in path)
    raise ValueError(f"no path from {config.entry} to {terminal}")


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def mean_delta(
    before: dict[str, float], after: dict[str, float], histogram: str, labels: str = ""
) -> float:
    """Mean of the observations a histogram received between two scrapes (NaN if none)."""
    suffix = f"{{{labels}}}" if labels else ""
    count = delta(before, after, f"{histogram}_count{suffix}")
    return delta(before, after, f"{histogram}_sum{suffix}") / count if count else math.nan


def path_compute(config: PipelineConfig, terminal: str, before: dict[str, float],
                 after: dict[str, float]) -> dict[str, float]:
    """Mean step seconds of each stage on the path to ``terminal`` over a window of scrapes."""
    means = {s: mean_delta(before, after, "pipeline_stage_seconds", f'stage="{s}"')
             for s in audio_path(config, terminal)}
    return {s: m for s, m in means.items() if not math.isnan(m)}


def turn_breakdown(probe: Probe, calls: set[str], compute_s: float) -> list[dict[str, float]]:
    """One row per answered request of ``calls``: the server-side stages of voice-to-voice."""
    call_of_track = {track: call for call, track in probe.track_of.items()}
    rows = []
    for enq in probe.enqueues:
        call, req = call_of_track.get(enq["track"]), enq["req"]
        if call not in calls or req not in probe.submits or req not in probe.first_audio:
            continue
        submit, (first_audio, _) = probe.submits[req], probe.first_audio[req]
        decisions = [t for t, kind, _ in probe.events[call]
                     if kind == "input_audio_buffer.speech_stopped" and t <= submit]
        first_frame = probe.first_frame(enq["track"], enq["t"], audible=True)
        if not decisions or first_frame is None:
            continue
        decision = decisions[-1]
        to_submit, ttfa = submit - decision, first_audio - submit
        to_enqueue = enq["t"] - first_audio
        rows.append({
            "call": call, "decision": decision, "to_submit": to_submit, "pipeline_ttfa": ttfa,
            "pipeline_overhead": ttfa - compute_s, "to_enqueue": to_enqueue,
            "tick_wait": first_frame - enq["t"], "voice_to_voice": first_frame - decision,
            "framework_overhead": to_submit + (ttfa - compute_s) + to_enqueue,
        })
    return rows


def client_turns(calls: list[ClientCall], rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per client turn: speech end → the server's decision (end-of-turn wait), and → first
    audio heard."""
    out = []
    for call in calls:
        decisions = sorted(r["decision"] for r in rows if r["call"] == call.call_id)
        for turn in call.turns:
            decision = next((d for d in decisions if d >= turn["speech_end"]), math.nan)
            out.append({"end_of_turn_wait": decision - turn["speech_end"],
                        "client_voice_to_voice": turn["first_audio"] - turn["speech_end"]})
    return out


def server_pacing(
    probe: Probe, tracks: list[str], start: float, end: float
) -> tuple[list[float], int]:
    """Frame gaps of ``tracks`` in [start, end], and the silent frames inside answers (underruns).

    An answer spans from the first audible frame after an item's enqueue to the last audible frame
    before the track's next enqueue or pause (a pause is a barge-in, not an underrun).
    """
    gaps: list[float] = []
    underruns = 0
    for track in tracks:
        frames = [(t, a) for t, a in probe.frames[track] if start <= t <= end]
        gaps.extend(np.diff([t for t, _ in frames]).tolist())
        cuts = sorted([e["t"] for e in probe.enqueues if e["track"] == track]
                      + [t for t, kind in probe.controls[track] if kind == "pause"] + [end])
        for begin, stop in itertools.pairwise(cuts):
            underruns += _silent_inside([a for t, a in frames if begin <= t < stop])
    return gaps, underruns


def _silent_inside(audible: list[bool]) -> int:
    """Silent entries between the first and the last audible one."""
    loud = [i for i, a in enumerate(audible) if a]
    return sum(1 for a in audible[loud[0] : loud[-1]] if not a) if loud else 0


def client_pacing(calls: list[ClientCall]) -> tuple[list[float], int, int]:
    """Arrival gaps at the clients, silent frames inside answers, and frames missing (pts jumps),
    all inside answers (first to last audible frame): while the agent is silent the server sends
    Opus DTX, a packet every 400 ms, so gaps and pts jumps there are by design."""
    gaps: list[float] = []
    underruns = missing = 0
    for call in calls:
        # An answer lies between the end of its question and the end of the next one: its last
        # frames can still arrive while the next question is being spoken.
        ends = [turn["speech_end"] for turn in call.turns] + [math.inf]
        for begin, stop in itertools.pairwise(ends):
            frames = [(t, peak > AUDIBLE, pts) for t, peak, pts in call.frames if begin <= t < stop]
            loud = [i for i, (_, audible, _) in enumerate(frames) if audible]
            if not loud:
                continue
            answer = frames[loud[0] : loud[-1] + 1]
            gaps.extend(np.diff([t for t, _, _ in answer]).tolist())
            pts = np.array([p for _, _, p in answer])
            missing += int(np.sum(np.maximum(np.diff(pts) // FRAME_PTS - 1, 0))) if len(pts) > 1 else 0
            underruns += _silent_inside([audible for _, audible, _ in answer])
    return gaps, underruns, missing


def barge_in_rows(probe: Probe, call: str, records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per interruption: server pause (metric), abort-to-clear (metric), and the times around it."""
    track = probe.track_of[call]
    rows = []
    for r in records:
        before, after = r["metrics_before"], r["metrics_after"]
        pauses = [t for t, kind in probe.controls[track] if kind == "pause" and t >= r["sent"]]
        pause = pauses[0] if pauses else math.nan
        silent_out = probe.first_frame(track, pause, audible=False) if pauses else None
        rows.append({
            "status": r["status"],
            "onset_to_pause": mean_delta(before, after, "duplex_barge_in_stop_seconds"),
            "pause_to_silent_frame": (silent_out or math.nan) - pause,
            "sent_to_pause": pause - r["sent"],
            "sent_to_client_silence": r["silent"] - r["sent"],
            "abort_to_clear": mean_delta(before, after, "pipeline_abort_clear_seconds"),
        })
    return rows
