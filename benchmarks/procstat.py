"""What a process started by a benchmark costs, read from Linux's /proc: CPU time and resident
memory of a process and all its descendants (a proxy with ``--workers N`` is N+1 processes).

CPU time is utime + stime in clock ticks (10 ms on most systems): measure over runs long enough
that a few ticks do not matter. A process that is gone counts as 0.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Final

_MAX_TREE: Final = 4096


def parse_vmrss_kib(status_text: str) -> int:
    """VmRSS in KiB from the text of /proc/<pid>/status (0 when absent, e.g. a zombie)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def parse_stat_cpu_ticks(stat_text: str) -> int:
    """utime + stime (clock ticks) from the text of /proc/<pid>/stat; the command name may hold spaces."""
    fields = stat_text[stat_text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return int(fields[11]) + int(fields[12])


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (via /proc/<pid>/task/*/children)."""
    seen: list[int] = []
    stack = [pid]
    while stack and len(seen) < _MAX_TREE:
        p = stack.pop()
        if p in seen:
            continue
        seen.append(p)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError):
                    stack.extend(int(c) for c in (task / "children").read_text().split())
    return seen


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by pid and its descendants."""
    ticks = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ticks += parse_stat_cpu_ticks(Path(f"/proc/{p}/stat").read_text())
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_rss_kib(pid: int) -> int:
    """Resident memory (KiB) of pid and its descendants."""
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            total += parse_vmrss_kib(Path(f"/proc/{p}/status").read_text())
    return total


def per_stream_kib(rss_before_kib: int, rss_after_kib: int, streams: int) -> float:
    """RSS growth per open stream (NaN with no stream open)."""
    return (rss_after_kib - rss_before_kib) / streams if streams > 0 else math.nan
