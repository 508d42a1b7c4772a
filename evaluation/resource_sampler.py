"""What a long-running benchmark watches on the server while clients load it: memory, file
descriptors, threads and processes of the server and its stage processes (from /proc), the
shared-memory segments they hold in /dev/shm, and the live-state gauges of ``/metrics``
(``pipeline_stage_live_requests`` per stage, ``pipeline_requests_active``, sessions).

A :class:`ResourceSampler` takes one :class:`Sample` a second in a task of the benchmark's own
event loop until stopped; ``summary`` compares the first and the last sample (the baseline and the
state after the load) and ``plot_samples`` draws the series. Used by evaluation/abort_storm.py and
evaluation/soak.py.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from evaluation.duplex_calls import scrape_metrics
from evaluation.proc_cpu import tree_pids
from harness.server import ServerProcess
from pipeline.transport.shm import SEGMENT_PREFIX, leftover_segments

_PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
IDLE_TIMEOUT_S = 60.0
T = TypeVar("T")


def _status_field(pid: int, name: str) -> int:
    """One numeric field of /proc/PID/status (0 when the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{name}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _rss_kb(pid: int) -> int:
    """Resident set of one process: /proc/PID/statm's second field, in pages."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE_KB
    except OSError:
        return 0


def _fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


@dataclass(frozen=True)
class Sample:
    """The server's resources at one moment; ``t`` is seconds since the sampler started."""

    t: float
    processes: int
    rss_mb: float  # the server process and every stage process, summed
    rss_main_mb: float  # the server process alone (sessions, transports, the coordinator)
    fds: int
    fds_main: int
    threads: int
    threads_main: int
    shm_segments: int
    shm_bytes: int
    requests_active: float
    sessions_active: float
    live: dict[str, float] = field(default_factory=dict)  # stage → pipeline_stage_live_requests

    live_total: float = 0.0  # the live gauges summed

    @classmethod
    def of(cls, live: dict[str, float], **fields: Any) -> Sample:
        return cls(live=live, live_total=sum(live.values()), **fields)


class ResourceSampler:
    """Samples one server (``server``, whose stage processes are its descendants) every
    ``interval_s`` while ``run`` is awaited; ``samples`` keeps every one, oldest first.

    Segments in /dev/shm are counted by the writer's pid in their name (``duplex-<pid>-...``), for
    every pid this server's tree ever had: /dev/shm is shared with anything else on the machine,
    and a stage process that died leaves its segments under a pid that is gone.
    """

    def __init__(self, server: ServerProcess, interval_s: float = 1.0) -> None:
        self.server = server
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._started = time.monotonic()
        self._pids_seen: set[int] = set()

    def now(self) -> float:
        """Seconds since the sampler started: the clock of every sample's ``t``."""
        return round(time.monotonic() - self._started, 2)

    async def take(self) -> Sample:
        """One sample now (also appended to ``samples``)."""
        pids = tree_pids(self.server.process.pid)
        self._pids_seen.update(pids)
        metrics = await scrape_metrics(self.server.url)
        segments = [p for p in leftover_segments() if self._writer_pid(p) in self._pids_seen]
        sample = Sample.of(
            t=self.now(),
            processes=len(pids),
            rss_mb=round(sum(_rss_kb(p) for p in pids) / 1024, 1),
            rss_main_mb=round(_rss_kb(pids[0]) / 1024, 1),
            fds=sum(_fd_count(p) for p in pids),
            fds_main=_fd_count(pids[0]),
            threads=sum(_status_field(p, "Threads") for p in pids),
            threads_main=_status_field(pids[0], "Threads"),
            shm_segments=len(segments),
            shm_bytes=sum(_size(p) for p in segments),
            requests_active=metrics["pipeline_requests_active"],
            sessions_active=sum(v for k, v in metrics.items()
                                if k.startswith("duplex_sessions_active{")),
            live={k.split('"')[1]: v for k, v in metrics.items()
                  if k.startswith("pipeline_stage_live_requests{")},
        )
        self.samples.append(sample)
        return sample

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            await self.take()
            await asyncio.sleep(self.interval_s)  # a fixed sampling period, not a wait for an event

    async def until_idle(self) -> Sample:
        """Sample until the server holds no session, no request and no per-request state in any
        stage (the gauges arrive with the stages' periodic stats, so they lag the events a little);
        returns that sample, or the last one after IDLE_TIMEOUT_S."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            sample = await self.take()
            idle = not (sample.sessions_active or sample.requests_active or sample.live_total)
            if idle or time.monotonic() > deadline:
                return sample
            await asyncio.sleep(self.interval_s)

    @staticmethod
    def _writer_pid(path: Path) -> int | None:
        pid = path.name.removeprefix(SEGMENT_PREFIX).split("-", 1)[0]
        return int(pid) if pid.isdigit() else None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # freed between the listing and the stat
        return 0


async def watch(sampler: ResourceSampler, load: Awaitable[T]) -> tuple[T, tuple[float, float]]:
    """Await ``load`` while ``sampler`` samples, then sample until the server is idle; returns the
    load's result and when it ran (seconds on the sampler's clock)."""
    started = (await sampler.take()).t
    sampling = asyncio.create_task(sampler.run())
    try:
        result = await load
    finally:
        ended = sampler.now()
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
    await sampler.until_idle()
    return result, (started, ended)


SERIES = ("rss_mb", "rss_main_mb", "fds", "fds_main", "threads", "threads_main", "processes",
          "shm_segments", "shm_bytes", "live_total", "requests_active", "sessions_active")


def baseline_table(samples: list[Sample]) -> dict[str, Any]:
    """Each series' baseline (the first sample), peak, end (the last sample) and change, as data
    (``resources``) and as a printable table; and whether what must return did
    (``back_at_baseline``: nothing live, no segment, no session, the same processes, fds and
    threads; RSS is reported, not judged, since allocators keep freed pages)."""
    first, last = samples[0], samples[-1]
    resources = {}
    for name in SERIES:
        values = [getattr(s, name) for s in samples]
        resources[name] = {"start": values[0], "max": max(values), "end": values[-1],
                           "change": round(values[-1] - values[0], 2)}
    rows = [[name, *resources[name].values()] for name in SERIES]
    return {
        "resources": resources,
        "live_by_stage_end": last.live,
        "table": [["series", "start", "max", "end", "change"], rows],
        "back_at_baseline": {
            "live_requests_zero": last.live_total == 0 and last.requests_active == 0,
            "no_shm_segments": last.shm_segments == 0,
            "sessions_zero": last.sessions_active == 0,
            "processes_same": last.processes == first.processes,
            "fds_same": last.fds == first.fds,
            "threads_same": last.threads == first.threads,
        },
    }


def as_json(samples: list[Sample]) -> list[dict[str, Any]]:
    return [asdict(s) for s in samples]


def plot_samples(samples: list[dict[str, Any]], path: Path, title: str,
                 spans: Sequence[tuple[float, float, str]] = ()) -> None:
    """Four panels over time (memory, fds and threads, shm, live state) from ``as_json`` samples;
    ``spans`` shades phases (start, end, label), e.g. the load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from evaluation.bench_common import save_figure

    t = [s["t"] for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    axes[0].plot(t, [s["rss_mb"] for s in samples], label="server + stages")
    axes[0].plot(t, [s["rss_main_mb"] for s in samples], label="server process")
    axes[0].set_ylabel("RSS (MB)")
    axes[1].plot(t, [s["fds"] for s in samples], label="open fds")
    axes[1].plot(t, [s["threads"] for s in samples], label="threads")
    axes[1].set_ylabel("count")
    axes[2].plot(t, [s["shm_segments"] for s in samples], label="segments")
    axes[2].set_ylabel("/dev/shm segments")
    stages = sorted({stage for s in samples for stage in s["live"]})
    for stage in stages:
        axes[3].plot(t, [s["live"].get(stage, 0) for s in samples], label=f"live: {stage}")
    axes[3].plot(t, [s["requests_active"] for s in samples], "k--", label="requests active")
    axes[3].plot(t, [s["sessions_active"] for s in samples], "k:", label="sessions")
    axes[3].set_ylabel("live state")
    axes[3].set_xlabel("seconds")
    for ax in axes:
        for start, end, label in spans:
            ax.axvspan(start, end, color="tab:orange", alpha=0.1,
                       label=label if ax is axes[0] else None)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    axes[0].set_title(title)
    save_figure(fig, path)
