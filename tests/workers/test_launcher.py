"""pd-workers against a fake ``vllm`` executable: ports, configs, health wait, start-up failures, stopping.

The real-vLLM launcher test is in tests/e2e/test_handoff_vllm.py; these run in seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kv_transfer.config import NIXL_PROGRESS_DIR
from workers import launcher
from workers import model as tiny
from workers.launcher import ClusterSettings, LaunchError, start_cluster

FAKE = Path(__file__).with_name("fake_vllm.py")


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.fixture
def fake_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Path]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    vllm = bin_dir / "vllm"
    vllm.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    vllm.chmod(0o755)
    records = tmp_path / "records"
    records.mkdir()
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "pd-model.json").write_text("{}")
    monkeypatch.setenv("FAKE_VLLM_RECORD_DIR", str(records))
    monkeypatch.setenv("FAKE_VLLM_MODE", "ok")
    paths = {"vllm": vllm, "records": records, "model": model, "logs": tmp_path / "logs", "tmp": tmp_path}
    yield paths
    # Safety net: nothing a test started may outlive it.
    for rec in records.glob("*.json"):
        data = json.loads(rec.read_text())
        for pid in (data["pid"], data["child_pid"]):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _settings(paths: dict[str, Path], **kw: Any) -> ClusterSettings:
    base: dict[str, Any] = {
        "model": paths["model"],
        "vllm_bin": paths["vllm"],
        "log_dir": paths["logs"],
        "startup_timeout": 30.0,
        "stop_timeout": 5.0,
    }
    return ClusterSettings(**{**base, **kw})


def _records(paths: dict[str, Path]) -> dict[int, dict[str, Any]]:
    return {int(p.stem): json.loads(p.read_text()) for p in paths["records"].glob("*.json")}


def _arg(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_cluster_has_unique_ports_role_configs_and_core_binding(fake_env: dict[str, Path]) -> None:
    state_file = fake_env["tmp"] / "state.json"
    settings = _settings(
        fake_env, prefill=2, decode=1, aggregated=1, cpu_cores=(0, 1), lease_seconds=5, state_file=state_file
    )
    with start_cluster(settings) as cluster:
        assert len(cluster.prefill_urls) == 2 and len(cluster.decode_urls) == 1
        assert len(cluster.aggregated_urls) == 1
        ports = [w.http_port for w in cluster.workers] + [
            w.side_channel_port for w in cluster.workers if w.side_channel_port is not None
        ]
        assert len(ports) == len(set(ports)) == 7
        assert all(w.url == f"http://127.0.0.1:{w.http_port}" for w in cluster.workers)
        records = _records(fake_env)
        assert set(records) == {w.http_port for w in cluster.workers}
        roles = {}
        for position, w in enumerate(cluster.workers):
            argv, env = records[w.http_port]["argv"], records[w.http_port]["env"]
            assert argv[:2] == ["serve", str(fake_env["model"])]
            assert _arg(argv, "--served-model-name") == "tiny-llama"
            assert _arg(argv, "--dtype") == "float32" and _arg(argv, "--max-model-len") == "512"
            assert "--enforce-eager" in argv and "--enable-scale-out" in argv
            assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(position % 2)  # round-robin, one core each
            assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
            assert env["HF_HUB_OFFLINE"] == "1"
            kv = _arg(argv, "--kv-transfer-config")
            if w.role == "aggregated":
                assert kv is None
                assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env
                assert "PD_NIXL_PROGRESS_DELAY_US" not in env
            else:
                # NIXL's progress thread sleeps between events (kv_transfer/nixl_progress)
                assert env["PD_NIXL_PROGRESS_DELAY_US"] == "1000"
                assert env["PYTHONPATH"].split(os.pathsep)[0] == str(NIXL_PROGRESS_DIR)
                assert kv is not None
                roles[w.role] = json.loads(kv)["kv_role"]
                assert json.loads(kv)["kv_connector_extra_config"] == {"kv_lease_duration": 5}
                assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(w.side_channel_port)
                assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert roles == {"prefill": "kv_producer", "decode": "kv_consumer"}
        state = json.loads(state_file.read_text())
        assert state["prefill"] == cluster.prefill_urls and state["aggregated"] == cluster.aggregated_urls
        pids = [p for tree in cluster.pids().values() for p in tree]
        assert len(pids) >= 8  # each worker: the server and its engine-like child
        assert all(rss > 0 for rss in cluster.rss_bytes().values())
    assert _wait_gone(pids) == []
    assert not state_file.exists()


def test_child_ignoring_sigterm_is_killed(fake_env: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "stubborn")
    cluster = start_cluster(_settings(fake_env, prefill=1, decode=0, stop_timeout=0.5))
    (record,) = _records(fake_env).values()
    assert _alive(record["child_pid"])
    cluster.stop()
    assert _wait_gone([record["pid"], record["child_pid"]]) == []
    cluster.stop()  # idempotent


def test_worker_dying_during_startup_is_reported_and_the_others_stopped(
    fake_env: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the decode worker dies (the fake decides by its command line).
    state_file = fake_env["tmp"] / "state.json"
    monkeypatch.setenv("FAKE_VLLM_DIE_IF_ARG", "kv_consumer")
    with pytest.raises(LaunchError) as info:
        start_cluster(_settings(fake_env, prefill=1, decode=1, state_file=state_file))
    message = str(info.value)
    assert not state_file.exists()  # written during start-up, removed with the workers
    assert "decode worker 0" in message and "exited with code 3" in message
    assert "boom, the engine failed to start" in message  # the log tail
    (prefill_record,) = _records(fake_env).values()  # the prefill worker had started
    assert _wait_gone([prefill_record["pid"], prefill_record["child_pid"]]) == []


def test_worker_never_healthy_times_out_and_is_stopped(
    fake_env: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")
    with pytest.raises(LaunchError, match=r"not healthy after") as info:
        start_cluster(_settings(fake_env, prefill=0, decode=0, aggregated=1, startup_timeout=1.0))
    assert "fake vllm starting in mode hang" in str(info.value)
    log = (fake_env["logs"] / "aggregated-0.log").read_text()
    assert "mode hang" in log
    # The hanging process was stopped: no process of ours still runs the fake.
    out = subprocess.run(
        ["pgrep", "-f", str(FAKE)], capture_output=True, text=True, check=False
    ).stdout.split()
    assert [int(p) for p in out if _alive(int(p))] == []


def test_down_stops_a_cluster_still_starting(
    fake_env: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state file exists from the moment the workers are spawned, so `down` works mid start-up."""
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")
    state_file = fake_env["tmp"] / "state.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.launcher", "up", "--prefill", "1", "--decode", "1",
         "--model", str(fake_env["model"]), "--vllm-bin", str(fake_env["vllm"]),
         "--log-dir", str(fake_env["logs"]), "--state-file", str(state_file), "--startup-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not state_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        state = json.loads(state_file.read_text())
        assert state["ready"] is False
        workers = launcher.read_state(state_file)
        pids = [p for w in workers for p in launcher.worker_pids(w)]
        assert len(workers) == 2 and pids
        os.kill(proc.pid, signal.SIGKILL)  # `up` dies without cleaning up
        proc.wait(timeout=10)
        assert launcher.main(["down", "--state-file", str(state_file), "--timeout", "2"]) == 0
        assert _wait_gone(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_up_detach_status_and_down(fake_env: dict[str, Path]) -> None:
    state_file = fake_env["tmp"] / "run" / "state.json"
    common = ["--state-file", str(state_file)]
    up = subprocess.run(
        [sys.executable, "-m", "workers.launcher", "up", "--prefill", "1", "--decode", "1",
         "--aggregated", "1", "--model", str(fake_env["model"]), "--vllm-bin", str(fake_env["vllm"]),
         "--log-dir", str(fake_env["logs"]), "--detach", "--nixl-progress-delay-us", "250", *common],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    printed = json.loads(up.stdout)
    assert printed == json.loads(state_file.read_text())
    assert len(printed["prefill"]) == len(printed["decode"]) == len(printed["aggregated"]) == 1
    records = _records(fake_env).values()
    pids = [p for r in records for p in (r["pid"], r["child_pid"])]
    assert len(pids) == 6 and all(_alive(p) for p in pids)
    assert sorted(r["env"].get("PD_NIXL_PROGRESS_DELAY_US", "-") for r in records) == ["-", "250", "250"]

    assert launcher.main(["status", *common]) == 0
    # A second `up` on the same state file refuses while the first cluster runs.
    assert (
        launcher.main(["up", "--model", str(fake_env["model"]), "--vllm-bin", str(fake_env["vllm"]), *common])
        == 1
    )

    assert launcher.main(["down", *common]) == 0
    assert _wait_gone(pids) == []
    assert not state_file.exists()
    assert launcher.main(["down", *common]) == 1  # nothing left to stop: a clear error


_WITH_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, getattr(signal, sys.argv[1])); "
                "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")
"""Runs the rest of its arguments (a Python command line) with SIGINT as ``argv[1]`` says
(``SIG_IGN`` survives ``exec``)."""


@pytest.mark.parametrize("inherited", ["SIG_DFL", "SIG_IGN"])
def test_cli_up_in_foreground_stops_everything_on_ctrl_c(fake_env: dict[str, Path], inherited: str) -> None:
    # SIG_IGN: as a launcher started in the background by a non-interactive shell inherits SIGINT
    # (bash ignores SIGINT and SIGQUIT for `cmd &`); Ctrl-C, sent explicitly, must still stop it.
    state_file = fake_env["tmp"] / "state.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WITH_SIGINT, inherited, "-m", "workers.launcher", "up",
         "--prefill", "1", "--decode", "1",
         "--model", str(fake_env["model"]), "--vllm-bin", str(fake_env["vllm"]),
         "--log-dir", str(fake_env["logs"]), "--state-file", str(state_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the URLs, printed once every worker is healthy
        assert json.loads(line)["decode"]
        pids = [p for r in _records(fake_env).values() for p in (r["pid"], r["child_pid"])]
        assert len(pids) == 4 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert _wait_gone(pids) == []
        assert not state_file.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_up_in_foreground_reports_a_worker_that_dies_and_stops_the_rest(
    fake_env: dict[str, Path],
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.launcher", "up", "--prefill", "1", "--decode", "1",
         "--model", str(fake_env["model"]), "--vllm-bin", str(fake_env["vllm"]),
         "--log-dir", str(fake_env["logs"]), "--state-file", str(fake_env["tmp"] / "state.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        urls = json.loads(proc.stdout.readline())
        records = _records(fake_env)
        decode = records[int(urls["decode"][0].rsplit(":", 1)[1])]
        prefill = records[int(urls["prefill"][0].rsplit(":", 1)[1])]
        os.kill(decode["pid"], signal.SIGKILL)  # the decode worker crashes
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 1
        assert "decode worker 0" in err and "exited" in err
        assert "fake vllm starting in mode ok" in err  # its log tail
        assert _wait_gone([prefill["pid"], prefill["child_pid"], decode["child_pid"]]) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_down_never_signals_a_recycled_pid(tmp_path: Path) -> None:
    """A state file whose PID now belongs to another process (other start time) leaves it alone."""
    bystander = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        worker = launcher.Worker(
            role="prefill", index=0, url="http://127.0.0.1:1", http_port=1, side_channel_port=2,
            pid=bystander.pid, start_ticks=0, log="x", command=["vllm"],
        )  # fmt: skip
        state = {"version": launcher.STATE_VERSION, "workers": [dataclasses.asdict(worker)]}
        (tmp_path / "s.json").write_text(json.dumps(state))
        assert launcher.main(["down", "--state-file", str(tmp_path / "s.json"), "--timeout", "0.5"]) == 0
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_settings_and_commands() -> None:
    with pytest.raises(LaunchError):
        ClusterSettings(model=Path("m"), prefill=0, decode=0, aggregated=0)
    with pytest.raises(LaunchError):
        ClusterSettings(model=Path("m"), prefill=-1)
    with pytest.raises(LaunchError):
        ClusterSettings(model=Path("m"), lease_seconds=0)
    with pytest.raises(LaunchError):
        ClusterSettings(model=Path("m"), nixl_progress_delay_us=-1)
    gpu = ClusterSettings(
        model=Path("/models/llama"), device="cuda", tokens_only=True, extra_args=("--tp", "2")
    )
    cmd = launcher.serve_command(gpu, Path("/usr/bin/vllm"), "decode", 8200)
    assert cmd[:3] == ["/usr/bin/vllm", "serve", "/models/llama"]
    assert "--dtype" not in cmd and "--max-model-len" not in cmd and "--enforce-eager" not in cmd
    assert "--served-model-name" not in cmd  # not a workers.model build: vLLM's own default name
    assert "--tokens-only" in cmd and "--enable-scale-out" not in cmd
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_buffer_device"] == "cuda"
    assert cmd[-2:] == ["--tp", "2"]


def test_vllm_bin_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LaunchError, match="no vLLM executable"):
        launcher.resolve_vllm_bin(tmp_path / "missing")
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "vllm").write_text("#!/bin/sh\n")
    (venv_bin / "vllm").chmod(0o755)
    monkeypatch.setenv("PD_VLLM_VENV", str(tmp_path / "venv"))
    assert launcher.resolve_vllm_bin() == venv_bin / "vllm"


def test_missing_model_folder_is_a_clear_error(fake_env: dict[str, Path]) -> None:
    with pytest.raises(LaunchError, match="does not exist"):
        start_cluster(_settings(fake_env, model=fake_env["tmp"] / "nope"))


def test_prefill_workers_publish_kv_events_on_their_own_loopback_ports(fake_env: dict[str, Path]) -> None:
    state_file = fake_env["tmp"] / "state.json"
    settings = _settings(fake_env, prefill=2, decode=1, aggregated=1, state_file=state_file)
    with start_cluster(settings) as cluster:
        records = _records(fake_env)
        described = cluster.describe()
        where = described["kv_events"]
        assert len(where) == 2
        ports = {w.http_port for w in cluster.workers} | {
            w.side_channel_port for w in cluster.workers if w.side_channel_port is not None
        }
        prefill = [w for w in cluster.workers if w.role == "prefill"]
        for w, listed in zip(prefill, where, strict=True):
            config = json.loads(_arg(records[w.http_port]["argv"], "--kv-events-config") or "")
            pub_port = int(config["endpoint"].rsplit(":", 1)[1])
            replay_port = int(config["replay_endpoint"].rsplit(":", 1)[1])
            # vLLM binds the PUB endpoint only in this form; it is the IPv4 loopback only.
            assert config == {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://[::ffff:127.0.0.1]:{pub_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                "buffer_steps": 10000,
                "hwm": 100000,
                "max_queue_size": 100000,
                "topic": "",
            }
            assert listed == {
                "endpoint": f"tcp://127.0.0.1:{pub_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                "topic": "",
            }
            assert pub_port not in ports and replay_port not in ports
            ports |= {pub_port, replay_port}
        assert len(ports) == 7 + 4
        for w in cluster.workers:
            if w.role != "prefill":
                assert "--kv-events-config" not in records[w.http_port]["argv"]
        state = json.loads(state_file.read_text())
        assert state["kv_events"] == where
        assert [w.kv_events for w in launcher.read_state(state_file) if w.role == "prefill"] == where


def test_kv_events_can_be_turned_off(fake_env: dict[str, Path]) -> None:
    with start_cluster(_settings(fake_env, prefill=1, decode=1, kv_events=False)) as cluster:
        assert cluster.describe()["kv_events"] == [None]  # still one entry per prefill worker
        assert all("--kv-events-config" not in r["argv"] for r in _records(fake_env).values())


def test_max_model_len_beyond_the_tiny_models_context_serves_a_longer_context_copy(
    fake_env: dict[str, Path],
) -> None:
    built = fake_env["tmp"] / "tiny"
    tiny.build_model(built)
    assert launcher.context_model(built, None) == built
    assert launcher.context_model(built, tiny.MAX_POSITION) == built
    assert launcher.context_model(fake_env["model"], 100_000) == fake_env["model"]  # not a build: as is
    with start_cluster(_settings(fake_env, model=built, prefill=1, decode=0, max_model_len=4096)) as cluster:
        variant = built.parent / "tiny-ctx4096"
        assert cluster.model_dir == variant and cluster.describe()["model"] == str(variant)
        (record,) = _records(fake_env).values()
        assert record["argv"][1] == str(variant) and _arg(record["argv"], "--max-model-len") == "4096"
        assert _arg(record["argv"], "--served-model-name") == "tiny-llama"
    config = json.loads((variant / "config.json").read_text())
    assert config["max_position_embeddings"] == 4096
    assert json.loads((variant / "tokenizer_config.json").read_text())["model_max_length"] == 4096
    assert tiny.is_complete(variant, 4096) and not tiny.is_complete(variant)
    base, longer = tiny.read_manifest(built), tiny.read_manifest(variant)
    assert base is not None and longer is not None and "max_position" not in base
    for name in ("model.safetensors", "tokenizer.json"):  # same weights and tokenizer
        assert base["sha256"][name] == longer["sha256"][name]
