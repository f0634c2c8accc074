"""deploy/install_prometheus.sh, run with stand-in apt tools on a PATH made for each case: it never
fails ``make up``, says clearly when it skips, refreshes the lists once before installing, and does
nothing when a prometheus binary is already there."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.deploy.metric_catalog import REPO
from tests.deploy.tools import run

SCRIPT = REPO / "deploy" / "install_prometheus.sh"
REAL_TOOLS = ("awk", "mktemp", "tail", "rm", "cat")


def fake_bin(tmp_path: Path, tools: dict[str, str]) -> dict[str, str]:
    """A PATH holding only the real helpers the script needs plus the given stand-in scripts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in REAL_TOOLS:
        real = shutil.which(tool)
        assert real is not None, tool
        (bin_dir / tool).symlink_to(real)
    for name, body in tools.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return {"PATH": str(bin_dir), "HOME": str(tmp_path), "CALLS": str(tmp_path / "calls.log")}


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


ROOT = {"id": "echo 0"}
APT_OK = {
    "apt-get": 'echo "apt-get $*" >> "$CALLS"; exit 0',
    "apt-cache": "echo 'prometheus:'; echo '  Candidate: 2.42.0+ds-5'",
}


def bash() -> str:
    found = shutil.which("bash")
    assert found is not None
    return found


def test_already_installed_does_nothing(tmp_path: Path) -> None:
    env = fake_bin(tmp_path, {**ROOT, **APT_OK, "prometheus": "exit 0"})
    result = run([bash(), str(SCRIPT)], env=env)
    assert result.returncode == 0
    assert "already installed" in result.stdout
    assert calls(tmp_path) == []


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        (ROOT, "no apt-get here"),
        ({"id": "echo 1000", **APT_OK}, "not root"),
        ({**ROOT, **APT_OK, "apt-cache": "echo '  Candidate: (none)'"}, "has no 'prometheus' package"),
        ({**ROOT, **APT_OK, "apt-get": 'echo "apt-get $*" >> "$CALLS"; exit 100'}, "apt-get update failed"),
    ],
)
def test_skips_clearly_and_never_fails(tmp_path: Path, tools: dict[str, str], message: str) -> None:
    env = fake_bin(tmp_path, tools)
    result = run([bash(), str(SCRIPT)], env=env)
    assert result.returncode == 0, result.stderr
    assert "SKIPPED" in result.stdout and message in result.stdout, result.stdout
    assert not any(" install " in c for c in calls(tmp_path))


def test_updates_once_then_installs(tmp_path: Path) -> None:
    env = fake_bin(tmp_path, {**ROOT, **APT_OK})
    result = run([bash(), str(SCRIPT)], env=env)
    assert result.returncode == 0, result.stderr
    assert "installing Debian package prometheus 2.42.0+ds-5" in result.stdout
    made = calls(tmp_path)
    assert [c.split()[1] for c in made] == ["update", "install"]
    assert made[1].endswith("--no-install-recommends prometheus")


def test_failed_install_is_reported_not_fatal(tmp_path: Path) -> None:
    failing = 'echo "apt-get $*" >> "$CALLS"; case "$*" in *install*) echo "E: broken" >&2; exit 100;; esac'
    env = fake_bin(tmp_path, {**ROOT, **APT_OK, "apt-get": failing})
    result = run([bash(), str(SCRIPT)], env=env)
    assert result.returncode == 0
    assert "SKIPPED: apt-get install prometheus failed" in result.stdout
    assert "E: broken" in result.stdout


def test_script_is_executable() -> None:
    assert os.access(SCRIPT, os.X_OK)
