"""What every benchmark under evaluation/ shares: the loopback-only namespace, percentile summaries,
a plain-text table, and the results folder (``evaluation/results/``, gitignored) for JSON and PNGs.

Nothing here holds state between calls.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "evaluation" / "results"
_REEXEC_MARK = "DUPLEX_BENCH_IN_NETNS"


def in_loopback_namespace() -> bool:
    """True when this process sees no network interface but ``lo``."""
    # Not /sys/class/net: unshare --net leaves /sys mounted from the namespace it came from.
    return {name for _, name in socket.if_nameindex()} <= {"lo"}


def run_in_loopback_namespace(module: str) -> None:
    """Re-execute ``python -m module <same args>`` in a fresh network namespace holding only ``lo``
    (as ``make test`` does), unless already in one; returns only when already there.

    ICE gathers every interface it sees: this is what keeps a benchmark's packets on loopback.
    """
    if in_loopback_namespace():
        return
    if os.environ.get(_REEXEC_MARK):
        raise SystemExit("unshare gave a namespace that still has interfaces besides lo")
    command = shlex.join([sys.executable, "-m", module, *sys.argv[1:]])
    env = dict(os.environ, **{_REEXEC_MARK: "1", "HF_HUB_OFFLINE": "1"})
    result = subprocess.run(
        ["unshare", "--net", "--", "bash", "-c", f"ip link set lo up && exec {command}"],
        cwd=ROOT, env=env, check=False,
    )
    raise SystemExit(result.returncode)


def summarize(values: Iterable[float], scale: float = 1000.0) -> dict[str, float | int | None]:
    """n, p50, p99, mean and max of ``values`` times ``scale`` (seconds → ms by default)."""
    data = np.asarray(list(values), dtype=np.float64) * scale
    if data.size == 0:
        return {"n": 0, "p50": None, "p99": None, "mean": None, "max": None}
    return {
        "n": int(data.size),
        "p50": round(float(np.percentile(data, 50)), 2),
        "p99": round(float(np.percentile(data, 99)), 2),
        "mean": round(float(data.mean()), 2),
        "max": round(float(data.max()), 2),
    }


def apply_stage_changes(pipeline: dict[str, Any], changes: Iterable[str],
                        fields: frozenset[str] = frozenset()) -> None:
    """Apply each ``STAGE.NAME=VALUE`` of ``changes`` (VALUE read as YAML) to a preset file's
    ``pipeline`` section: ``NAME`` is one of the stage's ``options``, or, where it is in
    ``fields``, a field of the stage itself (``threads``)."""
    stages = {s["name"]: s for s in pipeline["stages"]}
    for change in changes:
        key, _, value = change.partition("=")
        stage, _, name = key.partition(".")
        if stage not in stages or not name or not value:
            raise SystemExit(f"{change!r}: want STAGE.OPTION=VALUE with STAGE in {sorted(stages)}")
        target = stages[stage] if name in fields else stages[stage].setdefault("options", {})
        target[name] = yaml.safe_load(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A left-aligned plain-text table (None prints as ``-``)."""
    cells = [[str(h) for h in headers]]
    cells += [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(name: str, data: Any) -> Path:
    """``evaluation/results/<name>.json``; returns its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def machine() -> dict[str, Any]:
    """What the numbers were measured on: cores, and how busy the machine was."""
    return {"cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2)}


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Lay out ``fig``, write it to ``path`` and free it (every benchmark's plot ends so)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def save_results(name: str, results: Any, plot: Callable[[Any, Path], Any]) -> None:
    """``evaluation/results/<name>.json`` and ``<name>.png`` (drawn by ``plot``); prints both."""
    json_path = write_json(name, results)
    png_path = RESULTS_DIR / f"{name}.png"
    plot(results, png_path)
    print(f"\nwrote {json_path} and {png_path}")
