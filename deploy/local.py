"""``make up``: the whole P/D stack on this machine, in the foreground, until Ctrl-C.

    python -m deploy.local --model .cache/tiny-llama            # real vLLM on CPU (default)
    python -m deploy.local --workers sim                         # pd-sim workers: starts in a second

Starts, in order: the prefill and decode workers (real vLLM through :mod:`workers.launcher`, or pd-sim
processes), pd-proxy in front of them, and Prometheus (when a ``prometheus`` binary is on PATH; ``make
up`` tries to install Debian's package first) scraping the proxy and every worker with
``deploy/prometheus/prometheus.yml`` and generated targets files. Prints every URL, writes them as JSON
to ``--ready-file`` when asked, and then watches: Ctrl-C or SIGTERM stops everything (Prometheus, the
proxy, then the workers; each child in its own process group, SIGTERM then SIGKILL after a grace
period), and so does any child exiting on its own (exit status 1). Nothing is left running.
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any, Final

from deploy.targets import ALERT_RULES, DASHBOARDS_DIR, SCRAPE_CONFIG, Endpoints, write_atomic, write_targets

HOST: Final = "127.0.0.1"
DEFAULT_RUN_DIR: Final = Path("run/local")
STOP_GRACE_SECONDS: Final = 15.0


class StackError(RuntimeError):
    """A part of the stack could not be started; the message says which and where its log is."""


@dataclass
class Child:
    """A process this stack started, in its own process group."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class Stack:
    """What is running; stopped in reverse order of starting."""

    children: list[Child] = field(default_factory=list)
    cluster: Any = None  # workers.launcher.Cluster (imported lazily: --workers sim needs no vLLM)
    info: dict[str, Any] = field(default_factory=dict)

    def stop(self) -> None:
        for child in reversed(self.children):
            stop_child(child)
        self.children.clear()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def dead(self) -> str | None:
        for child in self.children:
            if not child.alive():
                return f"{child.name} exited with code {child.proc.returncode}; see {child.log}"
        if self.cluster is not None:
            for worker in self.cluster.dead_workers():
                return f"{worker.role} worker {worker.index} ({worker.url}) exited; see {worker.log}"
        return None


def stop_child(child: Child, grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``grace`` seconds; reap the child."""
    pgid = child.proc.pid  # started with start_new_session=True: its pid is its group id
    if child.proc.poll() is None or _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.proc.wait(timeout=grace)
    deadline = time.monotonic() + grace
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if child.proc.poll() is None or _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        child.proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def pick_port(wanted: int, what: str, out: IO[str]) -> int:
    """``wanted`` when it is free (0: any free port); a free one, said out loud, when it is taken."""
    if wanted == 0:
        return free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, wanted))
        except OSError:
            port = free_port()
            print(f"deploy.local: port {wanted} is taken; {what} uses {port} instead", file=out, flush=True)
            return port
    return wanted


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback http)
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until(ready: Callable[[], bool], child: Child, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if not child.alive():
            raise StackError(
                f"{child.name} exited with code {child.proc.returncode}; last lines of "
                f"{child.log}:\n{log_tail(child.log)}"
            )
        if time.monotonic() >= deadline:
            raise StackError(
                f"{what} not ready after {timeout:.0f} s; last lines of {child.log}:\n{log_tail(child.log)}"
            )
        time.sleep(0.2)


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def spawn(name: str, cmd: Sequence[str], log: Path) -> Child:
    """Start ``cmd`` in its own process group, its stdout and stderr appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as sink:
        proc = subprocess.Popen(
            list(cmd), stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Child(name, proc, log)


# ---------------------------------------------------------------------------------------------
# The parts.


def start_sim_workers(stack: Stack, prefill: int, decode: int, run_dir: Path, tokens_only: bool) -> None:
    """Start every pd-sim process at once, then collect the URL each one bound and wait for /health."""
    started: list[tuple[str, Child]] = []
    for role, count in (("prefill", prefill), ("decode", decode)):
        for index in range(count):
            log = run_dir / "logs" / f"{role}-{index}.log"
            log.unlink(missing_ok=True)  # the URL is read from this run's log
            cmd = [
                sys.executable, "-m", "workers.sim.cli", "--host", HOST, "--port", "0", "--role", role,
                "--tokens-only" if tokens_only else "--enable-scale-out",
            ]  # fmt: skip
            child = spawn(f"pd-sim {role}-{index}", cmd, log)
            stack.children.append(child)
            started.append((role, child))
    for role, child in started:
        url = _listening_url(child, timeout=30.0)
        health = f"{url}/health"
        wait_until(lambda: http_ok(health), child, 30.0, f"pd-sim {url}")  # noqa: B023 (called now)
        stack.info.setdefault(role, []).append(url)


def _listening_url(child: Child, timeout: float) -> str:
    """pd-sim prints the URL it bound on stdout (a JSON line ``{"event": "listening", "url": ...}``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            for line in child.log.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, AttributeError):
                    url = json.loads(line).get("url")
                    if isinstance(url, str):
                        return url
        if not child.alive():
            break
        time.sleep(0.05)
    raise StackError(
        f"{child.name} did not report its URL; last lines of {child.log}:\n{log_tail(child.log)}"
    )


def start_vllm_workers(stack: Stack, args: argparse.Namespace, run_dir: Path) -> None:
    from workers.launcher import ClusterSettings, LaunchError, start_cluster  # noqa: PLC0415

    settings = ClusterSettings(
        model=args.model,
        prefill=args.prefill,
        decode=args.decode,
        tokens_only=args.tokens_only,
        log_dir=run_dir / "logs",
        state_file=run_dir / "workers.json",
        startup_timeout=args.startup_timeout,
    )
    try:
        stack.cluster = start_cluster(settings)
    except LaunchError as exc:
        raise StackError(f"vLLM workers: {exc}") from None
    stack.info["prefill"] = list(stack.cluster.prefill_urls)
    stack.info["decode"] = list(stack.cluster.decode_urls)


def start_proxy(stack: Stack, port: int, run_dir: Path, extra: Sequence[str], name: str = "pd-proxy") -> str:
    """pd-proxy in front of the stack's workers, its log in ``logs/<name>.log``; its URL once healthy."""
    url = f"http://{HOST}:{port}"
    cmd = [
        sys.executable,
        "-m",
        "proxy.cli",
        "--prefill",
        *stack.info["prefill"],
        "--decode",
        *stack.info["decode"],
        "--host",
        HOST,
        "--port",
        str(port),
        # No --kv-block-size: pd-proxy reads each worker's KV block (pd-sim's 16, CPU vLLM's 128)
        # from its /metrics.
        *extra,
    ]
    child = spawn(name, cmd, run_dir / "logs" / f"{name}.log")
    stack.children.append(child)
    wait_until(lambda: http_ok(f"{url}/health"), child, 60.0, name)
    return url


def start_prometheus(stack: Stack, binary: str, port: int, run_dir: Path) -> str:
    base = run_dir / "prometheus"
    data = base / "data"
    shutil.rmtree(data, ignore_errors=True)  # a fresh TSDB each run
    write_atomic(base / "prometheus.yml", SCRAPE_CONFIG.read_text(encoding="utf-8"))
    write_atomic(base / "alerts.yml", ALERT_RULES.read_text(encoding="utf-8"))
    write_targets(
        base / "targets",
        Endpoints(proxies=[stack.info["proxy"]], prefill=stack.info["prefill"], decode=stack.info["decode"]),
    )
    url = f"http://{HOST}:{port}"
    cmd = [
        binary,
        f"--config.file={base / 'prometheus.yml'}",
        f"--storage.tsdb.path={data}",
        f"--web.listen-address={HOST}:{port}",
        "--storage.tsdb.retention.time=1d",
    ]
    child = spawn("prometheus", cmd, run_dir / "logs" / "prometheus.log")
    stack.children.append(child)
    wait_until(lambda: http_ok(f"{url}/-/ready"), child, 60.0, "Prometheus")
    return url


# ---------------------------------------------------------------------------------------------
# Command line.


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError("a port is 0 (pick a free one) to 65535")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m deploy.local", description="Run the P/D stack until Ctrl-C.")
    p.add_argument(
        "--workers",
        choices=("vllm", "sim"),
        default="vllm",
        help="real vLLM on CPU (default) or pd-sim simulated workers",
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument(
        "--model",
        type=Path,
        default=Path(os.environ.get("PD_MODEL_DIR", ".cache/tiny-llama")),
        help="vLLM: model folder (default $PD_MODEL_DIR or .cache/tiny-llama)",
    )
    p.add_argument("--tokens-only", action="store_true", help="workers run --tokens-only")
    p.add_argument("--port", type=_port, default=8000, help="pd-proxy port (0 picks a free one)")
    p.add_argument("--prometheus-port", type=_port, default=9090, help="Prometheus port (0 picks a free one)")
    p.add_argument("--no-prometheus", action="store_true", help="do not start Prometheus")
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="logs, targets and Prometheus data")
    p.add_argument("--ready-file", type=Path, help="write every URL and PID as JSON here once ready")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="vLLM workers' start-up bound")
    p.add_argument("--proxy-arg", action="append", default=[], help="extra pd-proxy argument (repeatable)")
    args = p.parse_args(argv)
    if args.prefill < 1 or args.decode < 1:
        p.error("--prefill and --decode must be at least 1")
    return args


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_as_keyboard() -> Iterator[None]:
    """SIGINT (even when a non-interactive shell started us with it ignored), SIGTERM and SIGHUP stop the
    stack like Ctrl-C does."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def ignoring_stop_signals() -> Iterator[None]:
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def describe(stack: Stack) -> dict[str, Any]:
    info = dict(stack.info)
    pids = {c.name: c.proc.pid for c in stack.children}
    if stack.cluster is not None:
        pids.update({f"vllm {w.role}-{w.index}": w.pid for w in stack.cluster.workers})
    info["pids"] = pids  # each one leads its own process group
    info["scrape_config"] = str(SCRAPE_CONFIG)
    info["dashboards"] = str(DASHBOARDS_DIR)
    return info


def print_urls(info: dict[str, Any], out: IO[str]) -> None:
    lines = [
        "",
        "pd-proxy stack is up (Ctrl-C stops everything):",
        f"  pd-proxy     {info['proxy']}/inference/v1/generate",
        f"               {info['proxy']}/health   {info['proxy']}/metrics",
    ]
    for role in ("prefill", "decode"):
        for url in info[role]:
            lines.append(f"  {role:<12} {url}   {url}/metrics")
    if info.get("prometheus"):
        lines.append(f"  Prometheus   {info['prometheus']}   targets: {info['prometheus']}/targets")
    else:
        lines.append(f"  Prometheus   not running: {info.get('prometheus_skipped')}")
    lines += [
        f"  scrape config {info['scrape_config']} (targets in {info['run_dir']}/prometheus/targets)",
        f"  dashboards    {info['dashboards']} (Grafana: deploy/compose or deploy/k8s)",
        f"  logs          {info['run_dir']}/logs",
        "",
    ]
    print("\n".join(lines), file=out, flush=True)


def run(args: argparse.Namespace, out: IO[str] = sys.stdout) -> int:
    run_dir = args.run_dir.absolute()
    stack = Stack(info={"workers": args.workers, "run_dir": str(run_dir)})
    try:
        with interrupts_as_keyboard():
            print(
                f"deploy.local: starting {args.prefill} prefill + {args.decode} decode {args.workers} "
                f"workers (logs in {run_dir / 'logs'})",
                file=out,
                flush=True,
            )
            if args.workers == "sim":
                start_sim_workers(stack, args.prefill, args.decode, run_dir, args.tokens_only)
            else:
                start_vllm_workers(stack, args, run_dir)
            proxy_port = pick_port(args.port, "pd-proxy", out)
            stack.info["proxy"] = start_proxy(stack, proxy_port, run_dir, args.proxy_arg)
            binary = shutil.which("prometheus")
            if args.no_prometheus:
                stack.info["prometheus_skipped"] = "--no-prometheus"
            elif binary is None:
                stack.info["prometheus_skipped"] = (
                    "no `prometheus` binary on PATH (make up installs Debian's package when it can)"
                )
            else:
                stack.info["prometheus"] = start_prometheus(
                    stack, binary, pick_port(args.prometheus_port, "Prometheus", out), run_dir
                )
            info = describe(stack)
            print_urls(info, out)
            if args.ready_file is not None:
                write_atomic(args.ready_file, json.dumps(info, indent=2) + "\n")
            while True:
                problem = stack.dead()
                if problem is not None:
                    print(f"deploy.local: {problem}; stopping everything", file=out, flush=True)
                    return 1
                time.sleep(0.5)
    except KeyboardInterrupt:
        print("deploy.local: stopping", file=out, flush=True)
        return 0
    except StackError as exc:
        print(f"deploy.local: {exc}", file=out, flush=True)
        return 1
    finally:
        # A second Ctrl-C (or a SIGTERM) while stopping would leave children behind: finish first.
        with ignoring_stop_signals():
            stack.stop()
        if args.ready_file is not None:
            args.ready_file.unlink(missing_ok=True)
        print("deploy.local: stopped; nothing left running", file=out, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
