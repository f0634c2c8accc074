"""``make up``'s entry point (``python -m deploy.local``) started in the background: requests go through
the proxy, Prometheus (when installed) scrapes the proxy and every worker, and stopping it leaves
nothing running. With pd-sim workers it takes seconds; the real-vLLM run is marked ``vllm``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import sse
from tests.deploy import dashboards as dash
from tests.deploy import metric_catalog as cat
from tests.fixtures_vllm import scrape_metrics


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    info: dict[str, Any]
    out: Path

    def pids(self) -> list[int]:
        return [int(p) for p in self.info["pids"].values()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False  # a zombie is dead; its parent reaps it
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return any(
        _alive(int(e.name))
        for e in Path("/proc").iterdir()
        if e.name.isdigit() and _pgid(int(e.name)) == pgid
    )


def _pgid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def stack(tmp_path: Path, *args: str, ready_timeout: float, port: int = 0) -> Iterator[Running]:
    """Start ``python -m deploy.local`` and yield once it wrote its ready file; always clean up."""
    ready = tmp_path / "ready.json"
    out = tmp_path / "stack.out"
    cmd = [
        sys.executable,
        "-m",
        "deploy.local",
        "--port",
        str(port),
        "--prometheus-port",
        "0",
        "--run-dir",
        str(tmp_path / "run"),
        "--ready-file",
        str(ready),
        *args,
    ]
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            cmd,
            cwd=cat.REPO,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    info: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + ready_timeout
        while not ready.exists():
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, "stack not ready in time:\n" + out.read_text()
            time.sleep(0.2)
        info = json.loads(ready.read_text())
        yield Running(proc, info, out)
    finally:
        if proc.poll() is None:  # the test failed before stopping it: stop it the normal way first
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=90)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in (int(p) for p in info.get("pids", {}).values()):  # groups this test started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def stop_and_check_nothing_left(running: Running, sig: signal.Signals = signal.SIGINT) -> str:
    running.proc.send_signal(sig)
    code = running.proc.wait(timeout=90)
    output = running.out.read_text()
    assert code == 0, output
    assert "nothing left running" in output
    left = [pid for pid in running.pids() if _group_alive(pid)]
    assert left == [], f"process groups still alive: {left}"
    return output


def post_json(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return int(resp.status), resp.read()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def generate_through_proxy(proxy: str) -> None:
    """One non-stream and one stream request, both answered by the decode pool."""
    # 157 tokens: past one 128-token KV block, so the proxy runs the prefill hop and the KV crosses
    # over NIXL (shorter prompts go decode-only); ids stay within the tiny model's vocabulary.
    body = {"token_ids": list(range(3, 160)), "sampling_params": {"max_tokens": 4, "temperature": 0}}
    status, raw = post_json(f"{proxy}/inference/v1/generate", body)
    reply = json.loads(raw)
    assert status == 200
    assert len(reply["choices"][0]["token_ids"]) == 4
    status, raw = post_json(f"{proxy}/inference/v1/generate", {**body, "stream": True})
    assert status == 200
    assert sse.done(raw, comments=True)
    tokens = [t for e in sse.json_events(raw, comments=True) for c in e["choices"] for t in c["token_ids"]]
    assert tokens == reply["choices"][0]["token_ids"]


def wait_for_scrapes(prometheus: str, running: Running, timeout: float) -> list[dict[str, Any]]:
    """Every target healthy and the proxy's request counter seen by Prometheus."""
    expected = {("pd-proxy", None)} | {("vllm", role) for role in ("prefill", "decode")}
    deadline = time.monotonic() + timeout
    while True:
        targets = get_json(f"{prometheus}/api/v1/targets")["data"]["activeTargets"]
        up = {(t["labels"]["job"], t["labels"].get("pool")) for t in targets if t["health"] == "up"}
        query = urllib.parse.quote('sum(pd_proxy_requests_total{outcome="ok"})')
        result = get_json(f"{prometheus}/api/v1/query?query={query}")["data"]["result"]
        counted = float(result[0]["value"][1]) if result else 0.0
        every = len(targets) == 1 + len(running.info["prefill"]) + len(running.info["decode"])
        if expected <= up and every and counted >= 2:
            return list(targets)
        assert time.monotonic() < deadline, f"targets {targets}, ok requests counted {counted}"
        time.sleep(0.5)


def check_prometheus(running: Running) -> None:
    prometheus = running.info.get("prometheus")
    if prometheus is None:
        pytest.skip(f"Prometheus not running: {running.info.get('prometheus_skipped')}")
    targets = wait_for_scrapes(prometheus, running, timeout=60)
    workers = {t["labels"]["worker"]: t["labels"]["pool"] for t in targets if t["labels"]["job"] == "vllm"}
    assert workers == {
        **dict.fromkeys(running.info["prefill"], "prefill"),
        **dict.fromkeys(running.info["decode"], "decode"),
    }


def check_proxy_metrics_match_agreed_names(proxy: str) -> None:
    """The proxy's real /metrics: every pd_proxy_* series it exposes is one of the agreed names, with
    agreed labels (so the dashboards' checks against the agreed list hold for the real proxy)."""
    agreed = cat.proxy_metrics()
    text = get_text(f"{proxy}/metrics")
    exposed = {n: labels for n, labels in cat.parse_exposition(text).items() if n.startswith("pd_proxy_")}
    exposed = {n: labels for n, labels in exposed.items() if not n.endswith("_created")}
    assert exposed, text[:500]
    for name, labels in exposed.items():
        assert name in agreed, f"{name} is not an agreed metric name"
        assert labels <= agreed[name].labels, f"{name} has labels {sorted(labels - agreed[name].labels)}"
    for name, values in cat.parse_samples(text):
        for label, value in values.items():
            allowed = agreed[name].values.get(label) if name in agreed else None
            assert allowed is None or value in allowed, f"{name}{{{label}={value!r}}} is not an agreed value"


# ---------------------------------------------------------------------------------------------


def test_sim_stack_serves_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    with stack(tmp_path, "--workers", "sim", "--no-prometheus", ready_timeout=60) as running:
        assert len(running.info["prefill"]) == 1 and len(running.info["decode"]) == 1
        generate_through_proxy(running.info["proxy"])
        check_proxy_metrics_match_agreed_names(running.info["proxy"])
        output = running.out.read_text()
        for url in (running.info["proxy"], *running.info["prefill"], *running.info["decode"]):
            assert url in output  # every URL printed
        assert str(cat.REPO / "deploy" / "prometheus" / "prometheus.yml") in output
        stop_and_check_nothing_left(running)
        assert not (tmp_path / "ready.json").exists()


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary (make up installs it)")
def test_sim_stack_prometheus_scrapes_proxy_and_every_worker(tmp_path: Path) -> None:
    with stack(tmp_path, "--workers", "sim", "--decode", "2", ready_timeout=60) as running:
        assert running.info["prometheus"]
        generate_through_proxy(running.info["proxy"])
        check_prometheus(running)
        stop_and_check_nothing_left(running)


def test_sim_stack_with_two_prefills_stops_on_sigterm(tmp_path: Path) -> None:
    with stack(
        tmp_path, "--workers", "sim", "--prefill", "2", "--no-prometheus", ready_timeout=60
    ) as running:
        assert len(running.info["prefill"]) == 2
        assert "prometheus" not in running.info
        assert "--no-prometheus" in running.out.read_text()
        generate_through_proxy(running.info["proxy"])
        stop_and_check_nothing_left(running, signal.SIGTERM)


def test_stack_stops_everything_when_a_part_dies(tmp_path: Path) -> None:
    with stack(tmp_path, "--workers", "sim", "--no-prometheus", ready_timeout=60) as running:
        os.kill(running.info["pids"]["pd-proxy"], signal.SIGKILL)  # a process this test started
        code = running.proc.wait(timeout=90)
        output = running.out.read_text()
        assert code == 1, output
        assert "pd-proxy exited" in output
        assert [pid for pid in running.pids() if _group_alive(pid)] == []


def test_startup_failure_is_reported_and_cleaned_up(tmp_path: Path) -> None:
    """A proxy that cannot start (a bad argument) stops the workers already running."""
    out = subprocess.run(
        [sys.executable, "-m", "deploy.local", "--workers", "sim", "--no-prometheus", "--port", "0",
         "--proxy-arg=--no-such-flag", "--run-dir", str(tmp_path / "run")],
        cwd=cat.REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pd-proxy exited" in out.stdout
    assert "--no-such-flag" in out.stdout  # the proxy's own complaint, from its log
    assert "nothing left running" in out.stdout
    logs = tmp_path / "run" / "logs"
    sims = [p for p in logs.glob("*-0.log")]
    assert len(sims) == 2


def test_a_taken_port_is_replaced_by_a_free_one(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with stack(tmp_path, "--workers", "sim", "--no-prometheus", ready_timeout=60, port=port) as running:
            assert f"port {port} is taken" in running.out.read_text()
            assert running.info["proxy"] != f"http://127.0.0.1:{port}"
            generate_through_proxy(running.info["proxy"])
            stop_and_check_nothing_left(running)


# ---------------------------------------------------------------------------------------------


def _vllm_ready() -> str | None:
    venv = Path(os.environ.get("PD_VLLM_VENV", cat.REPO / ".venv-vllm"))
    model = Path(os.environ.get("PD_MODEL_DIR", cat.REPO / ".cache" / "tiny-llama"))
    if not (venv / "bin" / "vllm").exists():
        return f"no vLLM at {venv} (make vllm)"
    if not model.is_dir():
        return f"no model at {model} (make model)"
    return None


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_stack_serves_scrapes_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    missing = _vllm_ready()
    if missing:
        pytest.skip(missing)
    model = os.environ.get("PD_MODEL_DIR", str(cat.REPO / ".cache" / "tiny-llama"))
    with stack(tmp_path, "--workers", "vllm", "--model", model, ready_timeout=600) as running:
        generate_through_proxy(running.info["proxy"])
        check_proxy_metrics_match_agreed_names(running.info["proxy"])
        # The dashboards' vLLM names against this run's real scrapes (not only the recorded traces).
        scraped: set[str] = set()
        for url in (*running.info["prefill"], *running.info["decode"]):
            scraped |= set(cat.parse_exposition(scrape_metrics(url)))
        files = dash.dashboard_files()
        named = {s.name for f in files for q in dash.queries(f) for s in dash.selectors(dash.parse(q.expr))}
        vllm_named = {n for n in named if n.startswith("vllm:")}
        assert vllm_named - scraped == set()
        # The requests really went P -> D: the decode worker pulled KV over NIXL.
        pulls = [
            float(line.rsplit(" ", 1)[1])
            for url in running.info["decode"]
            for line in scrape_metrics(url).splitlines()
            if line.startswith("vllm:nixl_xfer_time_seconds_count")
        ]
        assert sum(pulls) >= 2
        if running.info.get("prometheus"):
            check_prometheus(running)
        stop_and_check_nothing_left(running)


def fake_vllm(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """A stand-in ``vllm`` that never gets healthy and records its PID: start-up paths without vLLM."""
    venv = tmp_path / "fake-vllm"
    (venv / "bin").mkdir(parents=True)
    pids = tmp_path / "pids"
    pids.mkdir()
    script = venv / "bin" / "vllm"
    script.write_text(f'#!/bin/sh\necho $$ > "{pids}/$$"\nexec sleep 600\n')
    script.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    env = {**os.environ, "PD_VLLM_VENV": str(venv)}
    return env, pids, model


def recorded_pids(pids: Path) -> list[int]:
    return [int(p.name) for p in pids.iterdir()]


def test_vllm_startup_timeout_is_reported_and_cleaned_up(tmp_path: Path) -> None:
    env, pids, model = fake_vllm(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "deploy.local", "--model", str(model), "--startup-timeout", "3",
         "--run-dir", str(tmp_path / "run"), "--no-prometheus", "--port", "0"],
        cwd=cat.REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "not healthy after 3 s" in out.stdout
    assert len(recorded_pids(pids)) == 2  # one prefill and one decode were started ...
    assert [p for p in recorded_pids(pids) if _alive(p)] == []  # ... and stopped


def test_ctrl_c_during_vllm_startup_stops_the_workers(tmp_path: Path) -> None:
    env, pids, model = fake_vllm(tmp_path)
    out = tmp_path / "stack.out"
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.local", "--model", str(model), "--run-dir", str(tmp_path / "run"),
             "--no-prometheus", "--port", "0"],
            cwd=cat.REPO, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(recorded_pids(pids)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, out.read_text()
        assert "nothing left running" in out.read_text()
        assert [p for p in recorded_pids(pids) if _alive(p)] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in recorded_pids(pids):  # the stand-ins this test started, if anything went wrong
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
