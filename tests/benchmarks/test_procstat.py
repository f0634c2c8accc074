"""/proc readings of a process tree: the parsers on recorded text, the tree on this process."""

from __future__ import annotations

import math
import os
import subprocess

from benchmarks import procstat


def test_proc_parsers() -> None:
    status = "Name:\tpython\nVmPeak:\t  9000 kB\nVmRSS:\t   81564 kB\nThreads:\t4\n"
    assert procstat.parse_vmrss_kib(status) == 81564
    assert procstat.parse_vmrss_kib("Name:\tzombie\n") == 0
    stat = "1234 (tricky (name) x) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 37 0 0 20 0 4 0 500"
    assert procstat.parse_stat_cpu_ticks(stat) == 287
    assert procstat.per_stream_kib(1000, 65000, 1000) == 64.0
    assert math.isnan(procstat.per_stream_kib(1000, 2000, 0))


def test_tree_measurements_of_this_process() -> None:
    assert procstat.tree_rss_kib(os.getpid()) > 0
    assert procstat.tree_cpu_seconds(os.getpid()) > 0
    assert os.getpid() in procstat.process_tree(os.getpid())


def test_the_tree_holds_the_children_and_their_memory() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        tree = procstat.process_tree(os.getpid())
        assert child.pid in tree
        alone = procstat.tree_rss_kib(child.pid)
        assert alone > 0
        assert procstat.tree_rss_kib(os.getpid()) >= alone
    finally:
        child.kill()
        child.wait()
    assert child.pid not in procstat.process_tree(os.getpid())
