"""The project's import graph, read with ``ast`` (imports inside functions and under
TYPE_CHECKING count too): no circles, and the layers that must not reach into the proxy do not."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proxy", "kv_transfer", "workers", "benchmarks", "deploy")


def modules(root: Path = ROOT) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """Project modules ``path`` imports (``from a.b import c`` counts ``a.b.c`` when that is a
    module, else ``a.b``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            out.update(subs or ({node.module} & known.keys()))
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {m: imported(p, known) - {m} for m, p in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> Iterator[None]:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                yield from visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
        yield None

    for v in sorted(g):
        if v not in index:
            for _ in visit(v):
                pass
    return out


def test_no_import_circles() -> None:
    assert cycles(graph()) == []


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_layers_below_the_proxy_import_nothing_of_it() -> None:
    g = graph()
    reach = {m: sorted(d for d in deps if d == "proxy" or d.startswith("proxy.")) for m, deps in g.items()}
    assert {m: r for m, r in reach.items() if r and m.startswith("kv_transfer")} == {}
    assert {m: r for m, r in reach.items() if r and m.startswith("workers.sim")} == {}
    # pd-bench speaks HTTP; only the in-process micro-benchmarks time the proxy's own code
    assert {m: r for m, r in reach.items()
            if r and m.startswith("benchmarks") and not m.startswith("benchmarks.internals")} == {}


def test_the_graph_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "proxy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from proxy import b  # noqa\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from proxy.a import f\n")
    assert cycles(graph(tmp_path)) == [["proxy.a", "proxy.b"]]


# proxy/'s packages from the bottom up: a module may import its own package and the ones before it,
# never one after it. ``proxy.cli`` (the entry point) sits on top.
LAYERS = ("wire", "upstream", "pools", "fleet", "config", "sse", "observe", "walk", "stream", "openai",
          "http", "cli")


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "proxy" or len(parts) < 2:
        return None
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def upward_imports(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, d) for m, deps in g.items() for d in deps
                  if (lm := layer_of(m)) is not None and (ld := layer_of(d)) is not None and ld > lm)


def test_every_proxy_module_sits_in_a_layer() -> None:
    assert [m for m in graph() if m.startswith("proxy.") and layer_of(m) is None] == []


def test_no_layer_imports_one_above_it() -> None:
    assert upward_imports(graph()) == []


def test_an_upward_import_is_found() -> None:
    g = {"proxy.wire.a": {"proxy.http.b"}, "proxy.http.b": {"proxy.wire.a"}, "proxy.cli": {"proxy.http.b"}}
    assert upward_imports(g) == [("proxy.wire.a", "proxy.http.b")]


def test_no_folder_of_the_proxy_holds_more_than_twelve_modules() -> None:
    crowded = {str(d.relative_to(ROOT)): n for d in [ROOT / "proxy", *(ROOT / "proxy").rglob("*/")]
               if d.is_dir() and (n := len(list(d.glob("*.py")))) > 12}
    assert crowded == {}
