"""``pd-proxy --workers auto``: one process per CPU this process may use, capped by a cgroup CPU
quota (read from files whose paths the tests give); bad counts are usage errors; the start-up log
names the resolved count and that the limits hold per process."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import proxy.cli as cli
from proxy.cli import main, parse_args
from proxy.http.multiproc import CpuCount, available_cpus, cgroup_cpu_quota, parse_cpu_quota

WORKERS = ["--prefill", "http://127.0.0.1:8101", "--decode", "http://127.0.0.1:8201"]


def cgroup(tmp_path: Path, v2: str | None = None, v1: tuple[str, str] | None = None) -> dict[str, Path]:
    """Fake cgroup files under ``tmp_path``: v2's ``cpu.max`` and/or v1's quota and period."""
    cpu_max, v1_dir = tmp_path / "cpu.max", tmp_path / "cpu"
    if v2 is not None:
        cpu_max.write_text(v2 + "\n")
    if v1 is not None:
        v1_dir.mkdir()
        (v1_dir / "cpu.cfs_quota_us").write_text(v1[0] + "\n")
        (v1_dir / "cpu.cfs_period_us").write_text(v1[1] + "\n")
    return {"cpu_max": cpu_max, "v1_dir": v1_dir}


# ---------------------------------------------------------------- the quota


@pytest.mark.parametrize(("quota", "period", "cpus"), [
    ("200000", "100000", 2.0), ("150000", "100000", 1.5), ("50000", "100000", 0.5),
    ("max", "100000", None), ("-1", "100000", None), ("0", "100000", None), ("100000", "0", None),
    ("2.5", "1", None), ("", "100000", None),
])
def test_a_quota_in_cpus(quota: str, period: str, cpus: float | None) -> None:
    assert parse_cpu_quota(quota, period) == cpus


@pytest.mark.parametrize(("files", "cpus"), [
    ({"v2": "200000 100000"}, 2.0),                         # k8s limits.cpu: 2
    ({"v2": "max 100000"}, None),                           # no limit
    ({"v2": "max 100000", "v1": ("100000", "100000")}, None),  # v2 wins when it is there
    ({"v2": "garbage"}, None),
    ({"v1": ("300000", "100000")}, 3.0),                    # cgroup v1
    ({"v1": ("-1", "100000")}, None),
    ({}, None),                                             # neither (a bare host)
])
def test_the_cgroup_quota_from_its_files(tmp_path: Path, files: dict[str, Any], cpus: float | None) -> None:
    assert cgroup_cpu_quota(**cgroup(tmp_path, **files)) == cpus


@pytest.mark.parametrize(("affinity", "v2", "count"), [
    (64, "200000 100000", 2),   # a pod limited to 2 CPUs on a 64-core node: 2, not 64
    (64, "250000 100000", 2),   # rounded down: 3 busy processes would be throttled in turns
    (64, "50000 100000", 1),    # under one CPU: still one process
    (4, "800000 100000", 4),    # a quota above the affinity mask: the mask
    (6, "max 100000", 6),       # no quota: every CPU of the mask
])
def test_auto_is_one_process_per_cpu_within_the_quota(tmp_path: Path, affinity: int, v2: str,
                                                      count: int) -> None:
    cpus = available_cpus(affinity, **cgroup(tmp_path, v2=v2))
    assert cpus.count == count
    assert cpus.affinity == affinity


def test_what_auto_says_it_found(tmp_path: Path) -> None:
    assert available_cpus(64, **cgroup(tmp_path, v2="250000 100000")).describe() == \
        "2 of 64 CPUs: cgroup CPU quota 2.5"
    assert available_cpus(6, **cgroup(tmp_path / "nothing")).describe() == "6 CPUs available"
    assert CpuCount(count=1, affinity=1, quota=None).describe() == "1 CPU available"


def test_the_system_is_read_when_nothing_is_given() -> None:
    cpus = available_cpus()
    assert 1 <= cpus.count <= cpus.affinity


# ---------------------------------------------------------------- the flag


@pytest.fixture
def cpus(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Makes ``auto`` find the given CpuCount instead of the machine's."""
    def use(count: int, affinity: int, quota: float | None = None) -> None:
        monkeypatch.setattr(cli, "available_cpus", lambda: CpuCount(count, affinity, quota))
    return use


def test_auto_resolves_to_the_cpu_count(cpus: Any) -> None:
    cpus(3, 64, 3.0)
    assert parse_args([*WORKERS, "--workers", "auto"]).workers == 3
    assert parse_args([*WORKERS, "--workers", "AUTO"]).workers == 3
    assert parse_args([*WORKERS, "--workers", "2"]).workers == 2
    assert parse_args(WORKERS).workers == 1  # the plain CLI's default stays one process


def test_auto_from_the_config_file(tmp_path: Path, cpus: Any) -> None:
    cpus(4, 4)
    config = tmp_path / "proxy.yaml"
    config.write_text("workers: auto\n")
    assert parse_args([*WORKERS, "--config", str(config)]).workers == 4
    assert parse_args([*WORKERS, "--config", str(config), "--workers", "1"]).workers == 1  # the flag wins


@pytest.mark.parametrize("value", ["0", "-1", "abc", "", "1.5", "autox"])
def test_a_bad_count_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args([*WORKERS, f"--workers={value}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pd-proxy" in err
    assert f"argument --workers: expected a number of processes (1 or more) or auto, got {value!r}" in err


def test_a_bad_count_in_the_config_file_is_a_usage_error(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "proxy.yaml"
    config.write_text("workers: 0\n")
    with pytest.raises(SystemExit) as exit_:
        parse_args([*WORKERS, "--config", str(config)])
    assert exit_.value.code == 2
    assert "argument --workers: expected a number of processes" in capsys.readouterr().err


def test_auto_with_several_processes_needs_the_abort_broadcast(
        cpus: Any, capsys: pytest.CaptureFixture[str]) -> None:
    cpus(2, 2)
    with pytest.raises(SystemExit) as exit_:
        parse_args([*WORKERS, "--workers", "auto", "--no-abort-broadcast"])
    assert exit_.value.code == 2
    assert "--workers auto: 2 CPUs available gives 2 processes" in capsys.readouterr().err
    cpus(1, 1)  # one process: no other process for an abort to land on
    assert parse_args([*WORKERS, "--workers", "auto", "--no-abort-broadcast"]).workers == 1


# ---------------------------------------------------------------- start-up


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Records what ``main`` would start instead of serving."""
    seen: dict[str, Any] = {}

    def serve(settings: Any) -> None:
        seen["serve"] = settings.workers

    def run_workers(settings: Any, workers: int) -> int:
        seen["run_workers"] = workers
        return 0

    import proxy.http.multiproc  # noqa: PLC0415

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(proxy.http.multiproc, "run_workers", run_workers)
    return seen


def test_start_up_log_names_the_resolved_count_and_per_process_limits(
        cpus: Any, started: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    cpus(2, 64, 2.0)
    caplog.set_level(logging.INFO, logger="proxy.cli")
    with pytest.raises(SystemExit) as exit_:
        main([*WORKERS, "--workers", "auto", "--max-inflight", "100"])
    assert exit_.value.code == 0
    assert started == {"run_workers": 2}
    lines = [r.getMessage() for r in caplog.records if r.name == "proxy.cli"]
    assert "pd-proxy: 2 processes (--workers auto: 2 of 64 CPUs: cgroup CPU quota 2); limits hold per " \
           "process: --max-inflight 100 per process, up to 200 in all, and --max-queue, " \
           "--max-inflight-per-worker and the byte budgets likewise" in lines


def test_auto_that_comes_to_one_runs_the_single_process_server(
        cpus: Any, started: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    cpus(1, 64, 0.5)
    caplog.set_level(logging.INFO, logger="proxy.cli")
    main([*WORKERS, "--workers", "auto"])
    assert started == {"serve": 1}  # no supervisor, no spawned children
    assert any(r.getMessage().startswith("pd-proxy: 1 process (--workers auto: 1 of 64 CPUs: cgroup CPU "
                                          "quota 0.5); limits hold per process: --max-inflight 1024 per "
                                          "process, up to 1024 in all")
               for r in caplog.records)


def test_a_given_count_is_logged_as_given(started: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="proxy.cli")
    main(WORKERS)
    assert started == {"serve": 1}
    assert any(r.getMessage().startswith("pd-proxy: 1 process (--workers 1); limits hold per process")
               for r in caplog.records)
