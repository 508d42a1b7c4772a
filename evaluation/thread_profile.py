"""Where a server's main thread spends its CPU: a thread-CPU profiler and its breakdown by category.

``PROFILED_SERVE`` runs ``duplex.serve`` under cProfile with ``time.thread_time`` as its clock
(CPU of that thread only, so an idle wait costs nothing: sampling profilers here counted idle
waits as busy), switched on by SIGUSR1 and off by SIGUSR2, which writes the stats.
:func:`breakdown` charges each function's own time to a category by its file
(``CATEGORIES``); a builtin's time (onnxruntime, PyAV, libopus) goes to its callers' categories in
proportion, and the shares are scaled to the main thread's unprofiled CPU (the profiler's own
overhead inflates pure-Python code the most, so the shares of such code are upper bounds).
Used by ``evaluation.call_cpu``.
"""

from __future__ import annotations

import pstats
from collections import defaultdict
from pathlib import Path
from typing import Any

# Runs duplex.serve with a thread-CPU profiler that SIGUSR1 switches on and SIGUSR2 off (writing
# the stats to argv[1]). Passed to ``python -c`` so that it runs any checkout's duplex (cwd).
PROFILED_SERVE = """
import cProfile, runpy, signal, sys, time
profile = cProfile.Profile(timer=time.thread_time)
path = sys.argv[1]
def stop(*_):
    profile.disable()
    profile.dump_stats(path)
signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
signal.signal(signal.SIGUSR2, stop)
sys.argv = ["duplex.serve", *sys.argv[2:]]
runpy.run_module("duplex.serve", run_name="__main__", alter_sys=True)
"""

OTHER = "other (uvicorn, HTTP, prometheus, ...)"
LOOP = "event loop"

# Where a file's time is charged, by the first of these fragments its path holds.
CATEGORIES = (
    ("duplex/turns/", "VAD + turn detection"),
    ("duplex/media/resample", "inbound resampling"),
    ("duplex/media/", "outbound track (pacing, Opus packets)"),
    ("duplex/transports/webrtc", "WebRTC peer (duplex)"),
    ("duplex/", "session, events, metrics (duplex)"),
    ("pipeline/", "pipeline client"),
    ("aiortc/rtcrtpreceiver", "RTP receive + jitter buffer"),
    ("aiortc/jitterbuffer", "RTP receive + jitter buffer"),
    ("aiortc/rtcrtpsender", "RTP send"),
    ("aiortc/rtp.py", "RTP packets (parse, serialise, audio level)"),
    ("aiortc/codecs", "aiortc codecs (on the loop)"),
    ("aiortc/rtcdtlstransport", "SRTP + DTLS"),
    ("aiortc/rtcsctptransport", "SCTP (data channel)"),
    ("aiortc/", "aiortc other"),
    ("aioice/", "ICE"),
    ("asyncio/", "event loop"),
    ("selectors", "event loop"),
    ("uvloop", "event loop"),
    ("/threading.py", "event loop"),
)


def category(filename: str) -> str:
    for fragment, name in CATEGORIES:
        if fragment in filename:
            return name
    return OTHER


def shares(stats: dict[Any, Any], key: Any, seen: frozenset[Any] = frozenset()) -> dict[str, float]:
    """Which categories a function's own time belongs to: its file's, or, for a builtin or a
    library outside the categories (onnxruntime's wrapper, numpy, PyAV), its callers' in
    proportion to what each caller spent in it. Code the event loop calls directly stays
    ``OTHER``: a callback is not the loop's own work."""
    filename = key[0]
    own = category(filename) if filename != "~" else OTHER
    callers = stats[key][4]
    if own != OTHER or not callers or key in seen:
        return {own: 1.0}
    total = sum(edge[3] for edge in callers.values()) or 1.0
    parts: dict[str, float] = defaultdict(float)
    for caller, edge in callers.items():
        for name, part in shares(stats, caller, seen | {key}).items():
            parts[OTHER if name == LOOP else name] += part * edge[3] / total
    return parts


def breakdown(stats_path: Path, main_thread_percent: float) -> dict[str, Any]:
    """The profile's own time by category (percent of a core, scaled to ``main_thread_percent``)
    and its top functions by own time."""
    stats = pstats.Stats(str(stats_path)).stats  # type: ignore[attr-defined]
    charged: dict[str, float] = defaultdict(float)
    functions: dict[str, float] = defaultdict(float)
    for key, (_, _, own, _, _) in stats.items():
        filename, line, name = key
        functions[name if filename == "~" else f"{Path(filename).name}:{line}({name})"] += own
        for cat, part in shares(stats, key).items():
            charged[cat] += own * part
    whole = sum(charged.values()) or 1.0
    scale = main_thread_percent / whole
    top = sorted(functions.items(), key=lambda kv: -kv[1])[:15]
    return {
        "profiled_cpu_s": round(whole, 2),
        "categories_percent_of_a_core": {k: round(v * scale, 2) for k, v in
                                         sorted(charged.items(), key=lambda kv: -kv[1])},
        "top_functions_percent_of_a_core": {k: round(v * scale, 2) for k, v in top},
    }
