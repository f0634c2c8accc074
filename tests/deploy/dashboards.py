"""Reading the Grafana dashboards: every PromQL expression, and the metrics and labels each one names."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import promql_parser

from tests.deploy.metric_catalog import REPO, MetricSpec

DASHBOARDS: Final = REPO / "deploy" / "grafana" / "dashboards"

# Grafana's built-in and dashboard variables, replaced by values PromQL accepts.
_VARIABLES: Final = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "${__rate_interval}": "5m",
}
_DASH_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<query>.+),\s*)?(?P<label>[A-Za-z_][A-Za-z0-9_]*)\)$")


@dataclass(frozen=True)
class Query:
    dashboard: str
    where: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard}: {self.where}: {self.expr}"


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)


def load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def queries(path: Path) -> list[Query]:
    """Every PromQL expression of a dashboard: panel targets and query variables."""
    dash = load(path)
    uid = str(dash.get("uid"))
    out = []
    for panel in _panels(dash.get("panels", [])):
        for target in panel.get("targets", []):
            out.append(Query(uid, f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]))
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = _LABEL_VALUES.match(text.strip())
        if match is None:
            out.append(Query(uid, f"variable {var['name']}", text))
        elif match.group("query"):
            out.append(Query(uid, f"variable {var['name']}", match.group("query")))
    return out


def substitute(expr: str) -> str:
    """Replace Grafana's variables: intervals by durations, dashboard variables by a match-all regex."""
    for name, value in _VARIABLES.items():
        expr = expr.replace(name, value)
    return _DASH_VAR.sub(".*", expr)


def parse(expr: str) -> promql_parser.Expr:
    parsed = promql_parser.parse(substitute(expr))
    assert isinstance(parsed, promql_parser.Expr)
    return parsed


def selectors(expr: promql_parser.Expr) -> list[Selector]:
    found: list[Selector] = []

    def visit(node: promql_parser.Expr) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = tuple((m.name, str(m.op).rsplit(".", 1)[-1], m.value) for m in node.matchers.matchers)
            name = node.name or next((v for label, _, v in matchers if label == "__name__"), "")
            found.append(Selector(name, tuple(m for m in matchers if m[0] != "__name__")))
        return True

    promql_parser.walk(expr, pre_visit=visit)
    return found


def grouping_labels(expr: promql_parser.Expr) -> list[tuple[list[str], list[Selector]]]:
    """For each ``by (...)`` aggregation: its labels and the selectors it aggregates over."""
    found: list[tuple[list[str], list[Selector]]] = []

    def visit(node: promql_parser.Expr) -> bool:
        if (
            isinstance(node, promql_parser.AggregateExpr)
            and node.modifier is not None
            and node.modifier.type == promql_parser.AggModifierType.By
        ):
            found.append((list(node.modifier.labels), selectors(node.expr)))
        return True

    promql_parser.walk(expr, pre_visit=visit)
    return found


def _alternatives(regex: str) -> list[str] | None:
    """``a|b|c`` -> [a, b, c] when the regex is a plain alternation of literal names, else None."""
    parts = regex.split("|")
    return parts if all(re.fullmatch(r"[A-Za-z0-9_]+", p) for p in parts) else None


def problems(expr: str, known: Mapping[str, MetricSpec]) -> list[str]:
    """What is wrong with one expression: unknown metrics, labels a metric lacks, values never emitted."""
    try:
        tree = parse(expr)
    except ValueError as exc:
        return [f"does not parse: {exc}"]
    out: list[str] = []
    for sel in selectors(tree):
        spec = known.get(sel.name)
        if spec is None:
            out.append(f"metric {sel.name!r} is exposed by neither the proxy nor a vLLM worker")
            continue
        for label, op, value in sel.matchers:
            if label not in spec.labels:
                out.append(f"{sel.name} has no label {label!r}")
            allowed = spec.values.get(label)
            if allowed is None:
                continue
            values = [value] if op in ("Equal", "NotEqual") else _alternatives(value)
            for v in values or []:
                if v not in allowed:
                    out.append(f"{sel.name}{{{label}}} is never {v!r} (agreed: {sorted(allowed)})")
    for labels, inner in grouping_labels(tree):
        for sel in inner:
            spec = known.get(sel.name)
            if spec is None:
                continue
            missing = [label for label in labels if label not in spec.labels]
            if missing:
                out.append(f"by ({', '.join(labels)}) over {sel.name}, which has no {missing}")
    return out
