"""Size limits of the proxy's and the KV transfer's code, read with ``ast``: no module over 500
lines, no class over 300, no function (or method) over 60. A unit past its limit is split into
named parts, not let grow."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proxy", "kv_transfer")
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 500, 300, 60


def oversized(root: Path = ROOT) -> list[str]:
    """Every module, class and function past its limit, as ``path[:name]: lines > limit``."""
    out: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            rel = path.relative_to(root).as_posix()
            if (n := len(text.splitlines())) > MODULE_LINES:
                out.append(f"{rel}: {n} lines > {MODULE_LINES}")
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, ast.ClassDef):
                    limit = CLASS_LINES
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    limit = FUNCTION_LINES
                else:
                    continue
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                if span > limit:
                    out.append(f"{rel}:{node.lineno} {node.name}: {span} lines > {limit}")
    return out


def test_no_module_class_or_function_is_over_its_limit() -> None:
    assert oversized() == []


def test_each_limit_is_seen(tmp_path: Path) -> None:
    """One line past each limit is reported; a unit exactly at its limit is not."""
    pkg = tmp_path / "proxy"
    pkg.mkdir()
    (tmp_path / "kv_transfer").mkdir()

    def function(name: str, lines: int) -> str:
        return f"def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(lines - 1))

    (pkg / "f.py").write_text(function("long", FUNCTION_LINES + 1) + function("short", FUNCTION_LINES))
    methods = "".join(f"    def m{i}(self) -> None:\n        pass\n" for i in range(CLASS_LINES // 2))
    (pkg / "c.py").write_text(f"class Big:\n{methods}")
    (pkg / "d.py").write_text(f"class Fits:\n{methods[:methods.rindex('    def')]}")
    (pkg / "m.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    (pkg / "ok.py").write_text("x = 1\n" * MODULE_LINES)
    assert oversized(tmp_path) == [
        f"proxy/c.py:1 Big: {CLASS_LINES + 1} lines > {CLASS_LINES}",
        f"proxy/f.py:1 long: {FUNCTION_LINES + 1} lines > {FUNCTION_LINES}",
        f"proxy/m.py: {MODULE_LINES + 1} lines > {MODULE_LINES}",
    ]
