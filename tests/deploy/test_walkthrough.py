"""deploy/README.md's "From the CPU demo to GPU pools" uses only what ships: every file and folder it
names exists, every flag it names is one of pd-proxy's, pd-bench's, `make up`'s (deploy.local) or one of
the few of docker, kubectl and vLLM it shows, and every make target and module it runs is there."""

from __future__ import annotations

import argparse
import importlib
import re

from benchmarks.cli import build_parser as bench_parser
from proxy.cli import build_parser as proxy_parser
from tests.deploy.metric_catalog import REPO

README = REPO / "deploy" / "README.md"
HEADING = "## 4. From the CPU demo to GPU pools"
# Flags of the other tools the walk-through shows (docker run, kubectl scale, vllm serve).
OTHER_TOOLS = {"--rm", "--network", "--entrypoint", "--build", "--replicas", "--block-size", "--max-num-seqs"}


def section() -> str:
    text = README.read_text()
    assert HEADING in text
    body = text.split(HEADING, 1)[1]
    return body.split("\n## ", 1)[0]


def flags(parser: argparse.ArgumentParser) -> set[str]:
    out = {opt for action in parser._actions for opt in action.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= flags(sub)
    return out


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def local_flags() -> set[str]:
    """`make up`'s flags (UP_ARGS: python -m deploy.local), from its own parser."""
    local = importlib.import_module("deploy.local")

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> argparse.Namespace:
        raise _Captured(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture  # type: ignore[assignment,method-assign]
    try:
        local.parse_args([])
    except _Captured as captured:
        return flags(captured.parser)
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise AssertionError("deploy.local.parse_args built no parser")


def test_the_walkthrough_exists_and_covers_each_step() -> None:
    text = section()
    for step in ("make up", "deploy/compose/.env", "kubectl apply -k deploy/k8s/overlays/gpu", "/readyz",
                 "/livez", "model-cache-pvc", "--config", "pd-bench sweep", "KV block size"):
        assert step in text, step


def test_every_path_it_names_exists() -> None:
    paths = set(re.findall(r"(?<![\w/.-])((?:deploy|proxy|workers|benchmarks|run)/[\w./-]*\w)", section()))
    assert "deploy/compose/.env" in paths
    missing = []
    for path in paths:
        if path.startswith("run/"):  # made by `make up` when it runs
            continue
        if not (REPO / path).exists():
            missing.append(path)
    for rel in re.findall(r"\.\./\.\./(components/[\w-]+)", section()):
        if not (REPO / "deploy" / "k8s" / rel / "kustomization.yaml").is_file():
            missing.append(rel)
    assert missing == []


def test_every_flag_it_names_exists() -> None:
    known = flags(proxy_parser()) | flags(bench_parser()) | local_flags() | OTHER_TOOLS
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", section()))
    assert named and named - known == set()


def test_every_command_it_runs_exists() -> None:
    text = section()
    targets = set(re.findall(r"`make (\w+)", text))
    makefile = (REPO / "Makefile").read_text()
    assert targets and all(re.search(rf"^{t}:", makefile, re.MULTILINE) for t in targets), targets
    for module in set(re.findall(r"python -m ([\w.]+)", text)):
        importlib.import_module(module)
