"""``pd-workers``: start real vLLM prefill, decode and aggregated workers; stop them by PID.

CLI::

    pd-workers up --prefill N --decode M [--aggregated K] --model PATH [--tokens-only] [--vllm-bin PATH]
                  [--state-file F] [--log-dir D] [--lease-seconds S] [--device cpu|cuda] [--detach] ...
    pd-workers down [--state-file F]
    pd-workers status [--state-file F]

``up`` gives every worker its own free HTTP port and (P/D roles) NIXL side-channel port, and every
prefill worker a KV-event PUB port and replay port (``--kv-events-config``; ``kv_events`` in the JSON,
in the order of ``prefill``), starts them all
(each in its own process group: vLLM spawns an engine process and a worker process under the API
server), waits until each answers ``GET /health`` (bounded by ``--startup-timeout``), prints the URLs
as one JSON object on stdout and writes the same object to the state file. It then stays in the
foreground and stops everything on Ctrl-C or SIGTERM, or returns at once with ``--detach``.
``down`` reads the state file and stops the workers it names: SIGTERM to every process of each
worker's process group, then SIGKILL after a grace period, matching processes by PID, process group
and start time (never by name). A worker that dies or never gets healthy during start-up is reported
with the tail of its log, and the others are stopped.

Python API (what the test fixtures use)::

    with start_cluster(ClusterSettings(model=path, prefill=1, decode=1, log_dir=d)) as cluster:
        cluster.prefill_urls, cluster.decode_urls, cluster.aggregated_urls

CPU defaults follow docs/vllm.md, section 5: one core per worker (round-robin over the cores this process
may use), ``VLLM_CPU_KVCACHE_SPACE=1``, ``--dtype float32 --max-model-len 512 --enforce-eager``,
``--enable-scale-out`` (or ``--tokens-only``), ``kv_buffer_device: cpu``. Aggregated workers run
without a KV connector. The vLLM executable is a setting: ``--vllm-bin``, else
``$PD_VLLM_VENV/bin/vllm``, else ``.venv-vllm/bin/vllm`` (current directory, then the repository),
else ``vllm`` on PATH, so a GPU user's own vLLM works with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Final, Self

from kv_transfer.config import (
    DEFAULT_NIXL_PROGRESS_DELAY_US,
    Device,
    WorkerEnv,
    WorkerRole,
    kv_transfer_config,
    round_robin_cores,
    with_inherited,
    worker_env,
)
from kv_transfer.kv_events import KvEventsConfig

STATE_VERSION: Final = 1
DEFAULT_STATE_FILE: Final = Path("run/pd-workers.json")
DEFAULT_LOG_DIR: Final = Path("run/logs")
DEFAULT_SERVED_MODEL_NAME: Final = "tiny-llama"
TINY_MODEL_MANIFEST: Final = "pd-model.json"
LOG_TAIL_LINES: Final = 40
ROLES: Final[tuple[WorkerRole, ...]] = ("prefill", "decode", "aggregated")
REPO_ROOT: Final = Path(__file__).resolve().parent.parent


class LaunchError(RuntimeError):
    """A worker could not be started (it died, never got healthy, or the settings are unusable)."""


@dataclass(frozen=True)
class ClusterSettings:
    """Everything :func:`start_cluster` needs. Counts may be zero, but not all of them."""

    model: Path
    prefill: int = 1
    decode: int = 1
    aggregated: int = 0
    tokens_only: bool = False
    vllm_bin: Path | None = None
    log_dir: Path = DEFAULT_LOG_DIR
    state_file: Path | None = None
    lease_seconds: int | None = None
    device: Device = "cpu"
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    """None: ``tiny-llama`` when the model folder is a :mod:`workers.model` build, else vLLM's default."""
    cpu_cores: tuple[int, ...] | None = None
    """CPU: cores handed out round-robin, one per worker; None: the cores this process may run on."""
    cuda_devices: tuple[int, ...] | None = None
    """CUDA: devices handed out round-robin, one per worker; None leaves CUDA_VISIBLE_DEVICES alone."""
    kvcache_gib: int = 1
    nixl_progress_delay_us: int = DEFAULT_NIXL_PROGRESS_DELAY_US
    """CPU, P/D workers: NIXL's progress thread sleeps up to this between events; 0: NIXL's busy poll."""
    dtype: str | None = None
    """None: ``float32`` on CPU, vLLM's default on CUDA."""
    max_model_len: int | None = None
    """None: 512 on CPU, vLLM's default on CUDA. Longer than a :mod:`workers.model` build's context:
    a copy of the build with that context is made next to it (``<model>-ctx<N>``) and served."""
    kv_events: bool = True
    """Prefill workers publish their KV-cache events (a PUB and a replay port each, on ``host``)."""
    enforce_eager: bool | None = None
    """None: on for CPU (starts in half the time), vLLM's default on CUDA."""
    extra_args: tuple[str, ...] = ()
    startup_timeout: float = 300.0
    stop_timeout: float = 20.0

    def __post_init__(self) -> None:
        counts = (self.prefill, self.decode, self.aggregated)
        if min(counts) < 0 or sum(counts) == 0:
            raise LaunchError(f"worker counts must be non-negative and not all zero, got {counts}")
        if self.startup_timeout <= 0 or self.stop_timeout <= 0:
            raise LaunchError("timeouts must be positive")
        if self.lease_seconds is not None and self.lease_seconds <= 0:
            raise LaunchError("lease_seconds must be positive")
        if self.nixl_progress_delay_us < 0:
            raise LaunchError("nixl_progress_delay_us must be 0 or more")


@dataclass(frozen=True)
class Worker:
    """One started worker, as written to the state file."""

    role: WorkerRole
    index: int
    url: str
    http_port: int
    side_channel_port: int | None
    pid: int
    start_ticks: int
    log: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Only the variables the launcher added to the inherited environment."""
    kv_events: dict[str, str] | None = None
    """Prefill workers: where their KV events are published (``endpoint``, ``replay_endpoint``, ``topic``)."""


# ---------------------------------------------------------------------------------------------
# Processes: identified by PID + start time, stopped by process group, never by name.


@dataclass(frozen=True)
class _ProcInfo:
    pid: int
    state: str
    pgid: int
    start_ticks: int


def _proc_info(pid: int) -> _ProcInfo | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # Fields after the command name, which is in parentheses and may itself hold spaces or ")".
    rest = raw.rsplit(")", 1)[1].split()
    return _ProcInfo(pid=pid, state=rest[0], pgid=int(rest[2]), start_ticks=int(rest[19]))


def _group_members(pgid: int, leader_start_ticks: int) -> list[int]:
    """Live (non-zombie) processes of the group led by ``pgid`` when the leader started at that time.

    The kernel does not reuse a PID while a process group of that id exists, so when a process with
    PID ``pgid`` exists but started at another time, our group is gone and the id belongs to another.
    """
    leader = _proc_info(pgid)
    if leader is not None and leader.start_ticks != leader_start_ticks:
        return []
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        info = _proc_info(int(entry.name))
        if (
            info is not None
            and info.pgid == pgid
            and info.state != "Z"
            and info.start_ticks >= leader_start_ticks
        ):
            members.append(info.pid)
    return sorted(members)


def _rss_bytes(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def _signal_pids(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop_workers(
    workers: Sequence[Worker],
    timeout: float = 20.0,
    procs: Sequence[subprocess.Popen[bytes]] = (),
) -> list[int]:
    """Stop each worker's whole process group: politely first, by force after ``timeout``.

    1. SIGTERM to each group leader (the API server), which shuts its engine processes down and
       reaps them; 2. after half of ``timeout``, SIGTERM to every process of the groups still alive;
    3. after ``timeout``, SIGKILL to whatever is left. A worker's group is identified by its leader's
    PID and start time, so a recycled PID is never hit. ``procs`` are our own children (reaped here
    so they do not linger as zombies). Returns the PIDs that were signalled.
    """

    def members() -> list[int]:
        found: list[int] = []
        for w in workers:
            found += _group_members(w.pid, w.start_ticks)
        return found

    def wait_until(deadline: float) -> list[int]:
        while True:
            for p in procs:
                p.poll()
            left = members()
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)

    start = time.monotonic()
    signalled = set(members())
    leaders = [w.pid for w in workers if w.pid in signalled]
    _signal_pids(leaders, signal.SIGTERM)
    left = wait_until(start + timeout / 2)
    if left:
        _signal_pids(left, signal.SIGTERM)
        signalled.update(left)
        left = wait_until(start + timeout)
    if left:
        _signal_pids(left, signal.SIGKILL)
        signalled.update(left)
        wait_until(time.monotonic() + 10.0)
    return sorted(signalled)


# ---------------------------------------------------------------------------------------------
# Settings -> commands.


def resolve_vllm_bin(explicit: Path | None = None) -> Path:
    """The vLLM executable: explicit, else $PD_VLLM_VENV/bin/vllm, else a .venv-vllm, else PATH."""
    candidates: list[Path] = []
    if explicit is not None:
        candidates.append(explicit)
    elif venv := os.environ.get("PD_VLLM_VENV"):
        candidates.append(Path(venv) / "bin" / "vllm")
    else:
        candidates += [Path(".venv-vllm/bin/vllm"), REPO_ROOT / ".venv-vllm" / "bin" / "vllm"]
        on_path = shutil.which("vllm")
        if on_path:
            candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate.absolute()
    tried = ", ".join(str(c) for c in candidates) or "vllm on PATH"
    raise LaunchError(f"no vLLM executable found (tried {tried}); run `make vllm` or pass --vllm-bin")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports the OS reports free now (all sockets held open until all are picked)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def _served_model_name(settings: ClusterSettings) -> str | None:
    if settings.served_model_name is not None:
        return settings.served_model_name
    if (settings.model / TINY_MODEL_MANIFEST).is_file():
        return DEFAULT_SERVED_MODEL_NAME
    return None


def kv_events_config(host: str, pub_port: int, replay_port: int) -> tuple[KvEventsConfig, dict[str, str]]:
    """vLLM's ``--kv-events-config`` for a worker publishing on ``host``, and where to subscribe.

    vLLM binds the PUB endpoint only when it holds ``*`` or ``::`` (else it connects), so an IPv4
    address is given in its IPv6-mapped form, which binds that address only.
    """
    addr = f"[{host}]" if ":" in host else host
    pub = f"tcp://{addr}:{pub_port}" if ":" in host else f"tcp://[::ffff:{host}]:{pub_port}"
    config = KvEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=pub,
        replay_endpoint=f"tcp://{addr}:{replay_port}",
    )
    return config, {
        "endpoint": f"tcp://{addr}:{pub_port}",
        "replay_endpoint": config.replay_endpoint or "",
        "topic": config.topic,
    }


def context_model(model: Path, max_model_len: int | None) -> Path:
    """The model folder to serve for ``max_model_len``: ``model`` itself, or, when it is a
    :mod:`workers.model` build with a shorter context, a build with that context next to it
    (made now if missing; the build is local and deterministic)."""
    if max_model_len is None:
        return model
    try:
        manifest = json.loads((model / TINY_MODEL_MANIFEST).read_text())
    except (OSError, ValueError):
        return model
    if not isinstance(manifest, dict) or "recipe_version" not in manifest:
        return model
    from workers import model as tiny  # noqa: PLC0415 (numpy, tokenizers: only for this)

    if max_model_len <= tiny.max_position_of(manifest):
        return model
    variant = model.parent / f"{model.name}-ctx{max_model_len}"
    tiny.build_model(variant, max_position=max_model_len)
    return variant


def serve_command(
    settings: ClusterSettings,
    vllm_bin: Path,
    role: WorkerRole,
    http_port: int,
    kv_events: KvEventsConfig | None = None,
) -> list[str]:
    """The ``vllm serve`` command line of one worker."""
    cpu = settings.device == "cpu"
    cmd = [
        str(vllm_bin),
        "serve",
        str(settings.model.absolute()),
        "--host",
        settings.host,
        "--port",
        str(http_port),
    ]
    name = _served_model_name(settings)
    if name is not None:
        cmd += ["--served-model-name", name]
    dtype = settings.dtype if settings.dtype is not None else ("float32" if cpu else None)
    if dtype is not None:
        cmd += ["--dtype", dtype]
    max_len = settings.max_model_len if settings.max_model_len is not None else (512 if cpu else None)
    if max_len is not None:
        cmd += ["--max-model-len", str(max_len)]
    if settings.enforce_eager if settings.enforce_eager is not None else cpu:
        cmd.append("--enforce-eager")
    cmd.append("--tokens-only" if settings.tokens_only else "--enable-scale-out")
    kv = kv_transfer_config(role, device=settings.device, lease_seconds=settings.lease_seconds)
    if kv is not None:
        cmd += kv.cli_args()
    if kv_events is not None:
        cmd += ["--kv-events-config", kv_events.to_json()]
    cmd += settings.extra_args
    return cmd


def _available_cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as resp:  # noqa: S310 (http only)
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# The cluster.


class Cluster:
    """Running workers started by :func:`start_cluster`; a context manager that stops them on exit."""

    def __init__(
        self,
        settings: ClusterSettings,
        workers: list[Worker],
        procs: list[subprocess.Popen[bytes]],
        startup_seconds: float,
    ) -> None:
        self.settings = settings
        self.workers = workers
        self.startup_seconds = startup_seconds
        self._procs = procs
        self._stopped = False

    def urls(self, role: WorkerRole) -> list[str]:
        return [w.url for w in self.workers if w.role == role]

    @property
    def prefill_urls(self) -> list[str]:
        return self.urls("prefill")

    @property
    def decode_urls(self) -> list[str]:
        return self.urls("decode")

    @property
    def aggregated_urls(self) -> list[str]:
        return self.urls("aggregated")

    @property
    def model_dir(self) -> Path:
        return self.settings.model.absolute()

    @property
    def served_model_name(self) -> str:
        return _served_model_name(self.settings) or str(self.settings.model)

    def pids(self) -> dict[str, list[int]]:
        """Live PIDs of each worker's process tree (its process group), by URL."""
        return {w.url: worker_pids(w) for w in self.workers}

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of each worker's process tree, by URL (shared pages counted per process)."""
        return {url: _rss_bytes(pids) for url, pids in self.pids().items()}

    def dead_workers(self) -> list[Worker]:
        """Workers whose API-server process has exited."""
        by_pid = {p.pid: p for p in self._procs}
        return [w for w in self.workers if w.pid in by_pid and by_pid[w.pid].poll() is not None]

    def describe(self) -> dict[str, Any]:
        """The JSON object printed by ``pd-workers up`` and written to the state file."""
        return {
            "version": STATE_VERSION,
            "launcher_pid": os.getpid(),
            "model": str(self.model_dir),
            "served_model_name": self.served_model_name,
            "prefill": self.prefill_urls,
            "decode": self.decode_urls,
            "aggregated": self.aggregated_urls,
            "kv_events": [w.kv_events for w in self.workers if w.role == "prefill"],
            "ready": True,
            "startup_seconds": round(self.startup_seconds, 1),
            "workers": [asdict(w) for w in self.workers],
        }

    def stop(self) -> None:
        """Stop every worker (idempotent) and remove the state file if this cluster wrote it."""
        if self._stopped:
            return
        self._stopped = True
        stop_workers(self.workers, timeout=self.settings.stop_timeout, procs=self._procs)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=1.0)
        if self.settings.state_file is not None:
            _remove_state_file_if_ours(self.settings.state_file, self.workers)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _remove_state_file_if_ours(path: Path, workers: Sequence[Worker]) -> None:
    try:
        state = json.loads(path.read_text())
        ours = {(w["pid"], w["start_ticks"]) for w in state.get("workers", [])}
    except (OSError, ValueError, KeyError, TypeError):
        return
    if ours == {(w.pid, w.start_ticks) for w in workers}:
        path.unlink(missing_ok=True)


def _write_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


def _plan(settings: ClusterSettings) -> Iterator[tuple[WorkerRole, int]]:
    for role, count in zip(ROLES, (settings.prefill, settings.decode, settings.aggregated), strict=True):
        for index in range(count):
            yield role, index


def start_cluster(settings: ClusterSettings) -> Cluster:
    """Start the workers, wait until all are healthy and return the running :class:`Cluster`.

    Raises :class:`LaunchError` (after stopping whatever it started) when a worker dies during
    start-up or is not healthy within ``settings.startup_timeout``; the message holds its log tail.
    Ctrl-C during start-up also stops everything before the exception propagates.
    """
    if not settings.model.is_dir():
        raise LaunchError(f"model folder {settings.model} does not exist (run `make model`)")
    if settings.state_file is not None and settings.state_file.exists():
        try:
            live = workers_alive(read_state(settings.state_file))
        except LaunchError:
            live = []
        if live:
            raise LaunchError(
                f"{settings.state_file} names {len(live)} running worker(s); run `pd-workers down` first"
            )
    vllm_bin = resolve_vllm_bin(settings.vllm_bin)
    settings = dataclasses.replace(settings, model=context_model(settings.model, settings.max_model_len))
    plan = list(_plan(settings))
    n_ports = sum(1 if role == "aggregated" else 2 for role, _ in plan)
    n_ports += 2 * sum(1 for role, _ in plan if role == "prefill" and settings.kv_events)
    ports = iter(free_ports(n_ports, settings.host))
    cores = settings.cpu_cores or _available_cores()
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    workers: list[Worker] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for position, (role, index) in enumerate(plan):
            http_port = next(ports)
            side_port = None if role == "aggregated" else next(ports)
            spec = WorkerEnv(
                role=role,
                device=settings.device,
                side_channel_host=settings.host,
                side_channel_port=side_port,
                cpu_cores=round_robin_cores(position, cores) if settings.device == "cpu" else None,
                kvcache_gib=settings.kvcache_gib,
                nixl_progress_delay_us=settings.nixl_progress_delay_us,
                cuda_devices=(
                    round_robin_cores(position, settings.cuda_devices)
                    if settings.device == "cuda" and settings.cuda_devices
                    else None
                ),
            )
            added = worker_env(spec)
            env = with_inherited(added, os.environ)
            # Nothing can (or should) be fetched from a model hub; no usage reporting.
            for key, value in (("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1")):
                env.setdefault(key, value)
            events, events_where = None, None
            if role == "prefill" and settings.kv_events:
                events, events_where = kv_events_config(settings.host, next(ports), next(ports))
            cmd = serve_command(settings, vllm_bin, role, http_port, events)
            log_path = settings.log_dir / f"{role}-{index}.log"
            with log_path.open("wb") as log:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # own process group: the engine children go with it
                )
            procs.append(proc)
            info = _proc_info(proc.pid)
            workers.append(
                Worker(
                    role=role,
                    index=index,
                    url=f"http://{settings.host}:{http_port}",
                    http_port=http_port,
                    side_channel_port=side_port,
                    pid=proc.pid,
                    start_ticks=info.start_ticks if info else 0,
                    log=str(log_path.absolute()),
                    command=cmd,
                    env=added,
                    kv_events=events_where,
                )
            )
        if settings.state_file is not None:
            # Written before the wait so that `pd-workers down` can stop a cluster whose `up` died.
            _write_state(
                settings.state_file, {**Cluster(settings, workers, procs, 0.0).describe(), "ready": False}
            )
        _wait_healthy(workers, procs, settings.startup_timeout)
    except BaseException:
        stop_workers(workers, timeout=settings.stop_timeout, procs=procs)
        if settings.state_file is not None:
            _remove_state_file_if_ours(settings.state_file, workers)
        raise
    cluster = Cluster(settings, workers, procs, time.monotonic() - started)
    if settings.state_file is not None:
        _write_state(settings.state_file, cluster.describe())
    return cluster


def _wait_healthy(
    workers: Sequence[Worker], procs: Sequence[subprocess.Popen[bytes]], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    pending = dict(zip((w.url for w in workers), zip(workers, procs, strict=True), strict=True))
    while pending:
        for url, (worker, proc) in list(pending.items()):
            code = proc.poll()
            if code is not None:
                raise LaunchError(
                    f"{worker.role} worker {worker.index} ({url}) exited with code {code} during start-up; "
                    f"last lines of {worker.log}:\n{_log_tail(Path(worker.log))}"
                )
            if _healthy(url):
                del pending[url]
        if not pending:
            return
        if time.monotonic() >= deadline:
            worker = next(iter(pending.values()))[0]
            raise LaunchError(
                f"{len(pending)} worker(s) not healthy after {timeout:.0f} s, e.g. {worker.role} "
                f"worker {worker.index} ({worker.url}); last lines of {worker.log}:\n"
                f"{_log_tail(Path(worker.log))}"
            )
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# State file helpers (for `down` / `status` from another process).


def read_state(path: Path) -> list[Worker]:
    try:
        state = json.loads(path.read_text())
        if state.get("version") != STATE_VERSION:
            raise LaunchError(f"{path}: unknown state file version {state.get('version')!r}")
        return [Worker(**w) for w in state["workers"]]
    except FileNotFoundError as exc:
        raise LaunchError(f"no state file at {path}: nothing to stop") from exc
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LaunchError(f"{path} is not a pd-workers state file: {exc}") from exc


def worker_pids(worker: Worker) -> list[int]:
    """Live PIDs of a worker's process tree (its process group); empty once it is stopped."""
    return _group_members(worker.pid, worker.start_ticks)


def workers_alive(workers: Sequence[Worker]) -> list[Worker]:
    return [w for w in workers if worker_pids(w)]


def stop_from_state_file(path: Path, timeout: float = 20.0) -> list[int]:
    """Stop the workers a state file names and remove the file; returns the PIDs signalled.

    The file goes first, so a foreground ``pd-workers up`` sees its workers end as a requested stop;
    it is put back if stopping fails half-way.
    """
    text = path.read_text() if path.exists() else ""
    workers = read_state(path)
    path.unlink(missing_ok=True)
    try:
        return stop_workers(workers, timeout=timeout)
    except BaseException:
        path.write_text(text)
        raise


# ---------------------------------------------------------------------------------------------
# CLI.


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-workers", description="Start and stop real vLLM P/D workers.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start workers, print their URLs as JSON, stop them on Ctrl-C")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (kv_producer)")
    up.add_argument("--decode", type=int, default=1, help="decode workers (kv_consumer)")
    up.add_argument("--aggregated", type=int, default=0, help="workers without a KV connector")
    up.add_argument("--model", type=Path, required=True, help="model folder (e.g. .cache/tiny-llama)")
    up.add_argument("--tokens-only", action="store_true", help="--tokens-only instead of --enable-scale-out")
    up.add_argument("--vllm-bin", type=Path, help="vLLM executable (default: $PD_VLLM_VENV/bin/vllm, ...)")
    up.add_argument("--state-file", type=Path, default=DEFAULT_STATE_FILE)
    up.add_argument("--log-dir", type=Path, default=DEFAULT_LOG_DIR)
    up.add_argument("--lease-seconds", type=int, help="NIXL kv_lease_duration (vLLM default 30)")
    up.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    up.add_argument("--host", default="127.0.0.1", help="HTTP and NIXL side-channel address")
    up.add_argument("--served-model-name")
    up.add_argument("--cpu-cores", type=_int_list, help="CPU cores to hand out, one per worker (e.g. 0,1)")
    up.add_argument("--gpus", type=_int_list, help="CUDA devices to hand out, one per worker (e.g. 0,1,2,3)")
    up.add_argument("--kvcache-gib", type=int, default=1, help="CPU: VLLM_CPU_KVCACHE_SPACE")
    up.add_argument(
        "--nixl-progress-delay-us",
        type=int,
        default=DEFAULT_NIXL_PROGRESS_DELAY_US,
        help="CPU P/D workers: the longest NIXL's progress thread sleeps between events "
        f"(default {DEFAULT_NIXL_PROGRESS_DELAY_US}; 0: NIXL's busy poll, a core per worker)",
    )
    up.add_argument("--dtype")
    up.add_argument(
        "--max-model-len",
        type=int,
        help="context length (CPU default 512); longer than a `workers.model` build's: a copy of the "
        "build with that context is made next to it (<model>-ctx<N>) and served",
    )
    up.add_argument(
        "--no-kv-events", action="store_true", help="prefill workers publish no KV-cache events"
    )
    up.add_argument(
        "--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)"
    )
    up.add_argument("--startup-timeout", type=float, default=300.0)
    up.add_argument("--detach", action="store_true", help="return once healthy; stop later with `down`")
    down = sub.add_parser("down", help="stop the workers named in the state file")
    down.add_argument("--state-file", type=Path, default=DEFAULT_STATE_FILE)
    down.add_argument("--timeout", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL")
    status = sub.add_parser("status", help="health and memory of the workers named in the state file")
    status.add_argument("--state-file", type=Path, default=DEFAULT_STATE_FILE)
    return parser


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _up(args: argparse.Namespace) -> int:
    settings = ClusterSettings(
        model=args.model,
        prefill=args.prefill,
        decode=args.decode,
        aggregated=args.aggregated,
        tokens_only=args.tokens_only,
        vllm_bin=args.vllm_bin,
        log_dir=args.log_dir,
        state_file=args.state_file,
        lease_seconds=args.lease_seconds,
        device=args.device,
        host=args.host,
        served_model_name=args.served_model_name,
        cpu_cores=args.cpu_cores,
        cuda_devices=args.gpus,
        kvcache_gib=args.kvcache_gib,
        nixl_progress_delay_us=args.nixl_progress_delay_us,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_events=not args.no_kv_events,
        extra_args=tuple(args.vllm_arg),
        startup_timeout=args.startup_timeout,
    )
    # Ctrl-C (SIGINT) too, explicitly: started from a script in the background, the process
    # inherits SIGINT ignored and Python then installs no KeyboardInterrupt for it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_keyboard_interrupt)
    print(
        f"pd-workers: starting {args.prefill} prefill, {args.decode} decode, {args.aggregated} aggregated; "
        f"logs in {args.log_dir}",
        file=sys.stderr,
    )
    cluster: Cluster | None = None
    try:
        cluster = start_cluster(settings)
        print(json.dumps(cluster.describe()), flush=True)
        if args.detach:
            print(
                f"pd-workers: ready; stop with `pd-workers down --state-file {args.state_file}`",
                file=sys.stderr,
            )
            return 0
        print("pd-workers: ready; Ctrl-C stops them", file=sys.stderr)
        return _watch(cluster, args.state_file)
    except KeyboardInterrupt:
        print(
            "pd-workers: stopping" if cluster else "pd-workers: interrupted during start-up", file=sys.stderr
        )
        return 0 if cluster else 130
    finally:
        if cluster is not None and not args.detach:
            # A second Ctrl-C must not cut the (bounded) stop short and leave workers behind.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            cluster.stop()


def _watch(cluster: Cluster, state_file: Path) -> int:
    """Wait until a worker exits: 0 when `pd-workers down` stopped them, 1 (with its log tail) otherwise."""
    while True:
        dead = cluster.dead_workers()
        if dead:
            if not state_file.exists():
                print("pd-workers: stopped by `pd-workers down`", file=sys.stderr)
                return 0
            w = dead[0]
            print(
                f"pd-workers: {w.role} worker {w.index} ({w.url}) exited; last lines of {w.log}:\n"
                f"{_log_tail(Path(w.log))}\npd-workers: stopping the others",
                file=sys.stderr,
            )
            return 1
        time.sleep(1.0)


def _status(path: Path) -> int:
    workers = read_state(path)
    rows = []
    for w in workers:
        pids = _group_members(w.pid, w.start_ticks)
        rows.append(
            {
                "role": w.role,
                "index": w.index,
                "url": w.url,
                "alive": bool(pids),
                "healthy": bool(pids) and _healthy(w.url),
                "pids": pids,
                "rss_bytes": _rss_bytes(pids),
            }
        )
    print(json.dumps(rows, indent=2))
    return 0 if all(r["healthy"] for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "up":
            return _up(args)
        if args.command == "down":
            pids = stop_from_state_file(args.state_file, timeout=args.timeout)
            print(f"pd-workers: stopped {len(pids)} process(es)", file=sys.stderr)
            return 0
        return _status(args.state_file)
    except LaunchError as exc:
        print(f"pd-workers: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
