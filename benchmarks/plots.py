"""PNG plots (matplotlib's object API on the Agg canvas: no pyplot, no display needed). matplotlib is
imported when a plot is drawn, so pd-bench starts, and runs with --no-plots, without it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.metrics import chunk_itls, token_itls
from benchmarks.records import RequestRecord


def _figure(figsize: tuple[float, float]) -> Any:
    from matplotlib.figure import Figure  # noqa: PLC0415  (only when plots are drawn)

    return Figure(figsize=figsize)


def _cdf(ax: Any, values: Sequence[float], label: str, style: str = "-") -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values, dtype=np.float64) * 1000.0)
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, style, where="post", label=label)


def plot_cdfs(groups: Mapping[str, Sequence[RequestRecord]], path: str | Path) -> Path:
    """TTFT CDF and ITL CDFs (per chunk solid, per token dashed), one line per group."""
    fig = _figure((11, 4.2))
    ax1, ax2 = fig.subplots(1, 2)
    for label, recs in groups.items():
        ok = [r for r in recs if r.success and r.ttft_s is not None]
        _cdf(ax1, [r.ttft_s for r in ok if r.ttft_s is not None], label)
        _cdf(ax2, [g for r in ok for g in chunk_itls(r.chunk_times_s)], f"{label} per chunk")
        _cdf(
            ax2,
            [g for r in ok for g in token_itls(r.chunk_times_s, r.chunk_tokens)],
            f"{label} per token",
            "--",
        )
    ax1.set(title="TTFT", xlabel="ms", ylabel="fraction of requests")
    ax2.set(title="ITL", xlabel="ms", ylabel="fraction of gaps")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    return out


def plot_metric_cdfs(
    panels: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path, title: str = ""
) -> Path:
    """One CDF panel per metric (values already in ms), one line per target in each."""
    fig = _figure((4.2 * max(len(panels), 1), 4.0))
    axes = fig.subplots(1, max(len(panels), 1), squeeze=False)[0]
    for ax, (name, groups) in zip(axes, panels.items(), strict=False):
        for label, values in groups.items():
            _cdf(ax, [v / 1000.0 for v in values], label)
        ax.set(title=name, xlabel="ms", ylabel="fraction")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    return out


def plot_sweep(
    loads: Sequence[float], datas: Sequence[Mapping[str, Any]], load_name: str, path: str | Path
) -> Path:
    """Latency (median and p99 TTFT, TPOT, ITL) and throughput against the load of each point."""
    keep = [i for i, v in enumerate(loads) if math.isfinite(v)]  # "all at once" has no place on the axis
    x = [loads[i] for i in keep]
    datas = [datas[i] for i in keep]
    fig = _figure((11, 4.2))
    ax1, ax2 = fig.subplots(1, 2)
    for key, label, style in (
        ("median_ttft_ms", "TTFT median", "o-"),
        ("p99_ttft_ms", "TTFT p99", "o--"),
        ("median_tpot_ms", "TPOT median", "s-"),
        ("p99_tpot_ms", "TPOT p99", "s--"),
        ("median_itl_ms", "ITL median", "^-"),
        ("p99_itl_ms", "ITL p99", "^--"),
    ):
        ys = [d.get(key) for d in datas]
        pts = [(a, b) for a, b in zip(x, ys, strict=True) if isinstance(b, int | float)]
        if pts:
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax1.set(title="latency vs load", xlabel=load_name, ylabel="ms")
    ax2.plot(x, [d.get("output_throughput") or 0.0 for d in datas], "o-", label="output tok/s")
    ax2.set(title="throughput vs load", xlabel=load_name, ylabel="output tokens/s")
    ax3 = ax2.twinx()
    ax3.plot(x, [d.get("request_throughput") or 0.0 for d in datas], "s--", color="tab:orange", label="req/s")
    ax3.set_ylabel("requests/s")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if x and min(x) > 0 and max(x) / min(x) >= 8:  # doubling sweeps read best on a log axis
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [f"{v:g}" for v in x])
    ax1.legend(fontsize=8)
    h2, l2 = ax2.get_legend_handles_labels()
    h3, l3 = ax3.get_legend_handles_labels()
    ax2.legend(h2 + h3, l2 + l3, fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    return out


def plot_hops(labels: Sequence[str], datas: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Stacked mean TTFT breakdown per run: pd-proxy's hops plus the unattributed rest. None when
    no run carries server timings."""
    hops: list[str] = []
    for d in datas:
        for h in d.get("hops") or []:
            if h != "total" and h not in hops:
                hops.append(h)
    if not hops:
        return None
    fig = _figure((max(5.0, 1.2 * len(labels) + 3), 4.2))
    ax = fig.subplots()
    bottom = np.zeros(len(datas))
    for key, name in [
        *((f"mean_hop_{h}_ms", h) for h in hops),
        ("mean_ttft_unattributed_ms", "unattributed"),
    ]:
        vals = np.array([float(d.get(key) or 0.0) for d in datas])
        ax.bar(list(labels), vals, bottom=bottom, label=name)
        bottom += vals
    ax.plot(
        list(labels),
        [float(d.get("mean_ttft_ms") or 0.0) for d in datas],
        "k_",
        markersize=30,
        label="client TTFT",
    )
    ax.set(title="mean TTFT breakdown (pd-proxy Server-Timing)", ylabel="ms")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    return out
