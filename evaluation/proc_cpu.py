"""CPU time from /proc, without psutil: a process and all its descendants, and the whole machine.

Take a :class:`CpuSample` before and after a phase; ``CpuSample.usage(before, after)`` gives cores
busy on average (1.0 = one core fully used) for the root process, its descendants, this process,
the machine, and the machine minus all those (what other programs on a shared machine were doing
meanwhile). Processes that
start or end inside the window are counted only for the part /proc still shows at each end.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; everything after its last ')'.
    return text[text.rindex(")") + 2 :].split()


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None:
            tree.setdefault(int(fields[1]), []).append(int(entry))  # fields[1] is the ppid
    return tree


def tree_pids(root: int) -> list[int]:
    """``root`` and every live descendant (the server and its stage processes)."""
    tree, pids, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(tree.get(pid, []))
    return pids


def process_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 when it is gone)."""
    fields = _stat_fields(pid)
    # utime and stime are fields 14 and 15 of /proc/PID/stat, i.e. 11 and 12 after the name.
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / _TICK


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / _TICK


@dataclass(frozen=True)
class CpuSample:
    wall: float
    root: float
    descendants: float
    own: float
    machine: float

    @classmethod
    def take(cls, root: int) -> CpuSample:
        return cls(
            wall=time.monotonic(),
            root=process_seconds(root),
            descendants=sum(process_seconds(p) for p in tree_pids(root)[1:]),
            own=process_seconds(os.getpid()),
            machine=machine_busy_seconds(),
        )

    @staticmethod
    def usage(before: CpuSample, after: CpuSample) -> dict[str, float]:
        """Average cores busy between two samples: the server (its main process and the stage
        processes under it), this process (the clients), everything else, the machine."""
        wall = max(after.wall - before.wall, 1e-9)
        main = (after.root - before.root) / wall
        stages = (after.descendants - before.descendants) / wall
        own = (after.own - before.own) / wall
        machine = (after.machine - before.machine) / wall
        return {
            "seconds": round(wall, 2),
            "server_cores": round(main + stages, 3),
            "server_main_cores": round(main, 3),
            "stage_process_cores": round(stages, 3),
            "client_cores": round(own, 3),
            "other_cores": round(max(machine - main - stages - own, 0.0), 3),
            "machine_cores": round(machine, 3),
        }
