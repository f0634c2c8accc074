"""Starting and stopping the processes of a benchmark (benchmarks.sim_stack)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import sim_stack


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" in status.read_text()
    except OSError:
        return True


def test_stop_all_stops_a_logged_process_with_its_whole_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    with sim_stack.processes() as procs:
        # a shell that starts a grandchild: stopping by process group must reach both
        proc = sim_stack.start_logged(
            ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; wait"], tmp_path / "shell.log"
        )
        procs.append(proc)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (pid_file.exists() and pid_file.read_text().strip()):
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        assert not _gone(grandchild)
    assert proc.poll() is not None
    deadline = time.monotonic() + 5
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild)
    assert (tmp_path / "shell.log").read_text().startswith("$ sh -c")


def test_stop_all_of_one_leaves_the_others(tmp_path: Path) -> None:
    with sim_stack.processes() as procs:
        a = sim_stack.start_logged(["sleep", "300"], tmp_path / "a.log")
        b = sim_stack.start_logged(["sleep", "300"], tmp_path / "b.log")
        procs += [a, b]
        sim_stack.stop_all([a])
        assert a.poll() is not None
        assert b.poll() is None
    assert b.poll() is not None


def test_stop_all_of_a_process_in_our_group_signals_it_alone() -> None:
    # sim_stack.start_sim's processes share this one's group: only the process itself is stopped
    proc = subprocess.Popen(["sleep", "300"])
    sim_stack.stop_all([proc])
    assert proc.poll() is not None


async def test_wait_ready_fails_at_once_when_the_process_exits(tmp_path: Path) -> None:
    proc = sim_stack.start_logged([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "x.log")
    try:
        url = f"http://127.0.0.1:{sim_stack.free_port()}"
        with pytest.raises(RuntimeError, match="exited with code 3"):
            await sim_stack.wait_ready(url, proc, timeout_s=60)
    finally:
        sim_stack.stop_all([proc])
