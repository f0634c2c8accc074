"""``pd-proxy --workers N``: N processes serving one port.

The parent binds nothing that accepts: it reserves the port (a bound, never listening socket with
``SO_REUSEPORT``, which also resolves ``--port 0``), then starts N children (``spawn``: a fresh
interpreter each, nothing inherited but the settings). Each child binds its own listening socket
to the same address with ``SO_REUSEPORT`` and runs the ordinary single-process server
(``proxy.http.server.serve``) on it. The kernel spreads new connections over the children by a hash of
the connection's addresses: a burst of connections is shared out evenly, which a shared accept
socket does not do (one busy-looping ``accept`` can take the whole burst).

Every child is a complete proxy with its own request table, pools and KV-lease ledger. A request
and all its hops live in the process that accepted the client's connection. An abort may reach
another process (a new connection): that process does not know the id and sends it to every
worker of both pools (the broadcast rule, on by default), which reaches the request wherever it
runs. With ``--no-abort-broadcast`` such an abort is lost, so that flag and ``--workers`` > 1 are
refused together.

Metrics: prometheus_client's multiprocess mode. The parent points ``PROMETHEUS_MULTIPROC_DIR`` at
a fresh directory (or keeps the one already set) before starting the children; every child's
counters, histograms and gauges live in files there and ``GET /metrics``, whichever process
serves it, sums counters and histograms over all children, dead ones included, and combines
gauges per their mode (``proxy.observe.metrics``). Scrape-time collectors (pool state) report the view
of the process that served the scrape.

Admin changes: with the admin API on, the parent makes a directory for the run
(``tempfile.mkdtemp``, mode 0700) holding an append-only journal file, given to every child as
``PoolSettings.admin_journal``. A change (add, remove, drain a worker) taken by one child is
applied there at once and appended; the others apply it within 0.25 s (``proxy.fleet.journal``).
With ``--admin-port`` the parent also reserves the admin port (``SO_REUSEPORT``, resolving 0) and
every child listens on it too.

How many processes: ``--workers N``, or ``--workers auto`` for one per CPU this process may use
(:func:`available_cpus`): the CPUs of its affinity mask (``os.sched_getaffinity``; ``os.cpu_count``
where there is none), capped by the cgroup's CPU quota when it sets one (cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us``/``cpu.cfs_period_us``): a container limited to 2 CPUs on a 64-core node gets 2
processes, not 64. A quota is rounded down to whole CPUs (at least 1), so N single-threaded
processes busy at once stay within it instead of being throttled in turns. ``auto`` that comes
to 1 runs the ordinary single process (none of the machinery here).

Limits are per process: ``--max-inflight``, ``--max-queue``, ``--max-inflight-per-worker``, the
abort-broadcast queue and the slow-reader buffers each hold for one child, so the run as a whole
admits up to N times as much. Health probes, circuit breakers, preflight and KV leases are per
process too (each child probes every worker).

Shutdown: SIGTERM or SIGINT to the parent sends SIGTERM to every child once (each drains as a
single process does, ``--drain-timeout``); children still alive ``drain_timeout + 10`` s later
are killed. The children run in their own process group, so a terminal's Ctrl-C reaches the
parent only and every child gets exactly one signal; a child whose parent dies gets SIGTERM
(Linux ``PR_SET_PDEATHSIG``). A child that exits on its own (a crash) stops the others and the
parent exits non-zero: restarting is the service manager's job.
"""

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
"""cgroup v2: ``QUOTA PERIOD`` (microseconds) or ``max PERIOD`` (no quota), as the container sees it."""
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
"""cgroup v1: ``cpu.cfs_quota_us`` (-1: no quota) and ``cpu.cfs_period_us``."""


@dataclass(frozen=True, slots=True)
class CpuCount:
    """What ``--workers auto`` resolved to, and from what."""

    count: int
    """Processes to run: ``affinity``, capped by the quota rounded down (at least 1)."""
    affinity: int
    """CPUs this process may run on (its affinity mask, else ``os.cpu_count``)."""
    quota: float | None
    """CPUs the cgroup's quota allows (may be fractional); None: no quota."""

    def describe(self) -> str:
        """``4 CPUs available`` or ``2 of 64 CPUs: cgroup CPU quota 2.5``, for the start-up log."""
        if self.quota is None:
            return f"{self.affinity} CPU{'s' if self.affinity != 1 else ''} available"
        return f"{self.count} of {self.affinity} CPUs: cgroup CPU quota {self.quota:g}"


def parse_cpu_quota(quota: str, period: str) -> float | None:
    """CPUs a cgroup quota allows (``quota / period``); None for no quota (``max``, ``-1``) or a
    value that is not a positive number."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_quota(cpu_max: Path = CGROUP_CPU_MAX, v1_dir: Path = CGROUP_V1_CPU) -> float | None:
    """The CPU quota of this process's cgroup in CPUs, from cgroup v2's ``cpu.max`` or else v1's
    files; None when neither file is there or readable, or they set no quota."""
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
    """CPUs this process may run on: its affinity mask, else ``os.cpu_count()`` (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity on this platform
        return max(1, os.cpu_count() or 1)


def available_cpus(affinity: int | None = None, *, cpu_max: Path = CGROUP_CPU_MAX,
                   v1_dir: Path = CGROUP_V1_CPU) -> CpuCount:
    """``--workers auto``: one process per CPU of the affinity mask (read unless given), capped by
    the cgroup's CPU quota rounded down (at least 1). The cgroup files' paths are parameters, so
    that tests give their own."""
    cpus = affinity_cpus() if affinity is None else max(1, affinity)
    quota = cgroup_cpu_quota(cpu_max, v1_dir)
    count = cpus if quota is None else max(1, min(cpus, math.floor(quota)))
    return CpuCount(count=count, affinity=cpus, quota=quota)


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies (no orphaned children serving on)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def child_main(settings: ProxySettings, index: int, parent_pid: int, log_level: int = logging.INFO) -> None:
    """One worker process: its own listening socket on the shared port, the usual server."""
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
        """Until every child exited; the exit code for the parent."""
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
