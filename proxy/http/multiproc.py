"""``pd-proxy --workers N``: N processes serving one port (proxy/README.md, "``--workers N``").

The parent reserves the port (bound, never listening, ``SO_REUSEPORT``) and spawns N children, each
a complete proxy on its own ``SO_REUSEPORT`` listening socket. An abort that reaches another process
relies on the abort broadcast. Each child gets exactly one SIGTERM on shutdown; one that exits on
its own stops them all."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from proxy.config.settings import ProxySettings
from proxy.http.server import serve
from proxy.http.sockets import LISTEN_BACKLOG, reuseport_socket

log = logging.getLogger("pd_proxy")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
KILL_AFTER_DRAIN = 10.0
_PR_SET_PDEATHSIG = 1
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")


@dataclass(frozen=True, slots=True)
class CpuCount:
    """What ``--workers auto`` resolved to, and from what."""

    count: int
    affinity: int
    quota: float | None

    def describe(self) -> str:
        if self.quota is None:
            return f"{self.affinity} CPU{'s' if self.affinity != 1 else ''} available"
        return f"{self.count} of {self.affinity} CPUs: cgroup CPU quota {self.quota:g}"


def parse_cpu_quota(quota: str, period: str) -> float | None:
    """CPUs a cgroup quota allows; None for no quota or a value that is not a positive number."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_quota(cpu_max: Path = CGROUP_CPU_MAX, v1_dir: Path = CGROUP_V1_CPU) -> float | None:
    """This process's cgroup CPU quota in CPUs (v2, else v1); None when there is none."""
    try:
        fields = cpu_max.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        pass
    else:
        return parse_cpu_quota(*fields) if len(fields) == 2 else None
    try:
        return parse_cpu_quota((v1_dir / "cpu.cfs_quota_us").read_text(encoding="ascii").strip(),
                               (v1_dir / "cpu.cfs_period_us").read_text(encoding="ascii").strip())
    except (OSError, UnicodeDecodeError):
        return None


def affinity_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity on this platform
        return max(1, os.cpu_count() or 1)


def available_cpus(affinity: int | None = None, *, cpu_max: Path = CGROUP_CPU_MAX,
                   v1_dir: Path = CGROUP_V1_CPU) -> CpuCount:
    """``--workers auto``: the affinity CPUs capped by the cgroup quota rounded down (at least 1),
    so that the processes, busy at once, are not throttled in turns."""
    cpus = affinity_cpus() if affinity is None else max(1, affinity)
    quota = cgroup_cpu_quota(cpu_max, v1_dir)
    count = cpus if quota is None else max(1, min(cpus, math.floor(quota)))
    return CpuCount(count=count, affinity=cpus, quota=quota)


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def child_main(settings: ProxySettings, index: int, parent_pid: int, log_level: int = logging.INFO) -> None:
    os.setpgrp()  # a terminal's Ctrl-C goes to the parent only; it sends each child one SIGTERM
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        return

    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s %(name)s[{index}] %(message)s")
    sock = reuseport_socket(settings.host, settings.port)
    sock.listen(LISTEN_BACKLOG)
    serve(settings, sock=sock)


class Supervisor:
    """Starts the children and stops them all on a signal or when one of them exits."""

    def __init__(self, settings: ProxySettings, workers: int) -> None:
        if workers < 1:
            raise ValueError("--workers must be at least 1")
        if workers > 1 and not settings.abort_unknown_broadcast:
            raise ValueError("--workers > 1 needs the abort broadcast (an abort may reach another "
                             "process): drop --no-abort-broadcast")
        self.workers = workers
        self._reserved = reuseport_socket(settings.host, settings.port)
        port = self._reserved.getsockname()[1]
        self._admin_reserved: socket.socket | None = None
        pools = settings.pools
        if pools.admin_key and pools.admin_port is not None:
            try:
                self._admin_reserved = reuseport_socket(pools.admin_host, pools.admin_port)
            except OSError:
                self._reserved.close()
                raise
            pools = replace(pools, admin_port=self._admin_reserved.getsockname()[1])
        self.settings = replace(settings, port=port, pools=pools)
        self.journal_dir = ""
        self.children: list[BaseProcess] = []
        self._stopping = False
        self._own_metrics_dir = False
        self.metrics_dir = os.environ.get(METRICS_DIR_ENV) or ""

    @property
    def port(self) -> int:
        return self.settings.port

    @property
    def admin_port(self) -> int | None:
        return self.settings.pools.admin_port if self.settings.pools.admin_key else None

    def start(self) -> None:
        if not self.metrics_dir:
            self.metrics_dir = tempfile.mkdtemp(prefix="pd-proxy-metrics-")
            self._own_metrics_dir = True
            os.environ[METRICS_DIR_ENV] = self.metrics_dir  # inherited by the spawned children
        if self.settings.pools.admin_key and not self.journal_dir:
            self.journal_dir = tempfile.mkdtemp(prefix="pd-proxy-admin-")  # 0700: ours only
            journal = Path(self.journal_dir) / "journal.jsonl"
            os.close(os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            self.settings = replace(self.settings,
                                    pools=replace(self.settings.pools, admin_journal=journal))
        ctx = multiprocessing.get_context("spawn")
        for i in range(self.workers):
            proc = ctx.Process(target=child_main, args=(self.settings, i, os.getpid(),
                                                                 logging.getLogger().getEffectiveLevel()),
                               name=f"pd-proxy-worker-{i}", daemon=False)
            proc.start()
            self.children.append(proc)
        log.info("pd-proxy: %d worker processes on http://%s:%d (pids %s; metrics in %s)",
                 self.workers, self.settings.host, self.port,
                 ",".join(str(c.pid) for c in self.children), self.metrics_dir)
        if self.admin_port is not None:
            log.info("pd-proxy: admin API on %s://%s:%d/admin/workers (every process)",
                     "https" if self.settings.tls_cert_file else "http", self.settings.pools.admin_host,
                     self.admin_port)

    def stop(self) -> None:
        """SIGTERM once to every live child (idempotent)."""
        if self._stopping:
            return
        self._stopping = True
        for c in self.children:
            if c.pid is not None and c.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.pid, signal.SIGTERM)

    def wait(self) -> int:
        """Wait until every child exited; the exit code for the parent."""
        code = 0
        deadline: float | None = None
        while True:
            alive = [c for c in self.children if c.exitcode is None]
            if not alive:
                break
            if self._stopping and deadline is None:
                deadline = time.monotonic() + self.settings.drain_timeout + KILL_AFTER_DRAIN
            timeout = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            ready = multiprocessing.connection.wait([c.sentinel for c in alive], timeout)
            for c in alive:
                if c.sentinel in ready:
                    c.join()
                    self._mark_dead(c)
                    if not self._stopping:
                        log.error("pd-proxy worker %s (pid %s) exited with code %s: stopping all",
                                  c.name, c.pid, c.exitcode)
                        code = 1
                        self.stop()
            if deadline is not None and time.monotonic() >= deadline:
                for c in self.children:
                    if c.exitcode is None and c.pid is not None:
                        log.error("pd-proxy worker pid %s did not stop in time: killed", c.pid)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(c.pid, signal.SIGKILL)
                        c.join(5.0)
                        self._mark_dead(c)
                code = code or 1
                break
        return code

    def _mark_dead(self, child: BaseProcess) -> None:
        if child.pid is None or not self.metrics_dir:
            return
        with contextlib.suppress(Exception):
            from prometheus_client import multiprocess  # noqa: PLC0415

            multiprocess.mark_process_dead(child.pid, self.metrics_dir)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._reserved.close()
        if self._admin_reserved is not None:
            self._admin_reserved.close()
        if self.journal_dir:
            shutil.rmtree(self.journal_dir, ignore_errors=True)
        if self._own_metrics_dir:
            os.environ.pop(METRICS_DIR_ENV, None)
            shutil.rmtree(self.metrics_dir, ignore_errors=True)


def run_workers(settings: ProxySettings, workers: int) -> int:
    """Serve with ``workers`` processes until SIGTERM/SIGINT; returns the exit code."""
    sup = Supervisor(settings, workers)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("pd-proxy: signal %d, stopping %d workers", signum, len(sup.children))
        sup.stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        sup.start()
        return sup.wait()
    finally:
        sup.stop()
        for c in sup.children:
            if c.exitcode is None and c.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.pid, signal.SIGKILL)
                c.join(5.0)
        for s, h in previous.items():
            signal.signal(s, h)
        sup.close()


__all__ = [
    "CpuCount", "Supervisor", "affinity_cpus", "available_cpus", "cgroup_cpu_quota", "child_main",
    "parse_cpu_quota", "reuseport_socket", "run_workers",
]
