"""Which metric names and labels exist: the agreed proxy metrics (issue 7) and real vLLM workers.

The proxy's list is the one agreed between the metrics work and the dashboards (names, label names and
the closed sets of label values). The workers' list comes from real vLLM 0.32.0 scrapes: the traces'
``metrics-pd-prefill.txt``, ``metrics-pd-decode.txt`` and ``metrics-scaleout.txt`` in the repository's
``tests/data/traces/vllm-0.32.0-cpu/`` (``PD_TRACE_DIR``, as for ``tests.traces``), else the names in
``vllm_metrics.txt`` (a test keeps the two equal).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from tests.traces import TRACE_DIR

HERE: Final = Path(__file__).resolve().parent
REPO: Final = HERE.parents[1]
VENDORED_VLLM: Final = HERE / "vllm_metrics.txt"
TRACE_FILES: Final = ("metrics-pd-prefill.txt", "metrics-pd-decode.txt", "metrics-scaleout.txt")

# Labels Prometheus adds to every series of a target (deploy/prometheus/prometheus.yml and the
# k8s ServiceMonitor): job and instance always; namespace from the ServiceMonitor (the Prometheus
# Operator's target labels; file_sd targets have none, and the dashboards' `namespace=~".*"` matches a
# missing label); pool and worker on worker targets only.
PROXY_TARGET_LABELS: Final = frozenset({"job", "instance", "namespace"})
WORKER_TARGET_LABELS: Final = frozenset({"job", "instance", "namespace", "pool", "worker"})
# Series Prometheus makes itself for each target.
SYNTHETIC: Final = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

_OUTCOME = frozenset({"ok", "client_error", "upstream_error", "aborted", "timeout", "rejected",
                      "internal_error"})
_STAGE = frozenset({"queue", "prefill", "handoff", "decode_first_token", "decode_stream", "first_to_second"})
_SOURCE = frozenset({"client_call", "disconnect", "deadline", "shutdown"})
_STATE = frozenset({"prefilling", "kv_held", "decoding", "done", "unknown"})
_REASON = frozenset({"pulled", "aborted", "expired", "unknown"})
_POOL = frozenset({"prefill", "decode"})


@dataclass(frozen=True)
class MetricSpec:
    """One exposed series name with its label names and, where agreed, each label's allowed values."""

    labels: frozenset[str]
    values: Mapping[str, frozenset[str]] = field(default_factory=dict)


def _histogram(name: str, labels: Iterable[str] = (), **values: frozenset[str]) -> dict[str, MetricSpec]:
    own = frozenset(labels)
    return {
        f"{name}_bucket": MetricSpec(own | {"le"}, values),
        f"{name}_sum": MetricSpec(own, values),
        f"{name}_count": MetricSpec(own, values),
    }


def proxy_metrics() -> dict[str, MetricSpec]:
    """The agreed pd-proxy metrics, as exposed series names (``_bucket``/``_sum``/``_count``, ``_total``)."""
    m: dict[str, MetricSpec] = {
        "pd_proxy_requests_total": MetricSpec(frozenset({"outcome"}), {"outcome": _OUTCOME}),
        "pd_proxy_upstream_requests_total": MetricSpec(frozenset({"pool", "worker"}), {"pool": _POOL}),
        "pd_proxy_upstream_errors_total": MetricSpec(frozenset({"pool", "worker", "error"}), {"pool": _POOL}),
        "pd_proxy_inflight_requests": MetricSpec(frozenset({"pool"}), {"pool": _POOL}),
        "pd_proxy_worker_healthy": MetricSpec(frozenset({"pool", "worker"}), {"pool": _POOL}),
        "pd_proxy_circuit_state": MetricSpec(frozenset({"pool", "worker"}), {"pool": _POOL}),
        "pd_proxy_aborts_total": MetricSpec(
            frozenset({"source", "state"}), {"source": _SOURCE, "state": _STATE}
        ),
        "pd_proxy_abort_fanout_total": MetricSpec(frozenset({"pool", "result"}), {"pool": _POOL}),
        "pd_proxy_kv_leases_open": MetricSpec(frozenset()),
        "pd_proxy_kv_leases_closed_total": MetricSpec(frozenset({"reason"}), {"reason": _REASON}),
        "pd_proxy_prefill_missing_kv_params_total": MetricSpec(frozenset()),
        "pd_proxy_decode_only_total": MetricSpec(frozenset({"reason"})),
        "pd_proxy_suspect_no_transfer_total": MetricSpec(frozenset()),
        "pd_proxy_retries_total": MetricSpec(frozenset({"hop"})),
        "pd_proxy_migrations_total": MetricSpec(frozenset()),
        "pd_proxy_queue_rejections_total": MetricSpec(frozenset()),
        "pd_proxy_build_info": MetricSpec(frozenset({"version"})),
        "pd_proxy_upstream_resends_total": MetricSpec(
            frozenset({"hop", "result"}), {"result": frozenset({"resent", "abort_failed"})}),
        "pd_proxy_slow_reader_ended_total": MetricSpec(
            frozenset({"limit"}), {"limit": frozenset({"stream", "total"})}),
        "pd_proxy_slow_reader_buffered_bytes": MetricSpec(frozenset()),
        "pd_proxy_slow_reader_budget_bytes": MetricSpec(frozenset()),
        "pd_proxy_first_token_mismatch_total": MetricSpec(frozenset()),
        "pd_proxy_decode_prompt_tokens_total": MetricSpec(
            frozenset({"pool", "worker", "source"}),
            {"pool": frozenset({"decode"}),
             "source": frozenset({"local_compute", "local_cache_hit", "external_kv_transfer"})}),
        "pd_proxy_decode_expected_local_tokens_total": MetricSpec(
            frozenset({"pool", "worker"}), {"pool": frozenset({"decode"})}),
        "pd_proxy_decode_local_prefill_tokens_total": MetricSpec(
            frozenset({"pool", "worker"}), {"pool": frozenset({"decode"})}),
        "pd_proxy_decode_failed_pulls_total": MetricSpec(
            frozenset({"pool", "worker"}), {"pool": frozenset({"decode"})}),
    }
    m.update({
        "pd_proxy_kv_events_batches_total": MetricSpec(frozenset()),
        "pd_proxy_kv_events_total": MetricSpec(frozenset()),
        "pd_proxy_kv_events_gaps_total": MetricSpec(frozenset()),
        "pd_proxy_kv_events_replays_total": MetricSpec(
            frozenset({"result"}), {"result": frozenset({"ok", "incomplete"})}),
        "pd_proxy_kv_events_resets_total": MetricSpec(frozenset({"reason"}), {"reason": frozenset(
            {"connect", "restart", "gap", "disconnect", "unhealthy", "error"})}),
        "pd_proxy_kv_prompt_tokens_total": MetricSpec(frozenset()),
        "pd_proxy_kv_index_blocks": MetricSpec(frozenset({"worker"})),
        "pd_proxy_kv_events_usable": MetricSpec(frozenset({"worker"})),
        "pd_proxy_kv_events_stale_workers": MetricSpec(frozenset()),
    })
    m.update(_histogram("pd_proxy_kv_predicted_cached_tokens"))
    m.update(_histogram("pd_proxy_kv_reported_cached_tokens"))
    for name in ("ttft", "itl", "tpot", "e2e"):
        m.update(_histogram(f"pd_proxy_{name}_seconds"))
    m.update(_histogram("pd_proxy_stage_seconds", ["stage"], stage=_STAGE))
    m.update(_histogram("pd_proxy_kv_lease_duration_seconds"))
    return m


_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?:[-+]?[0-9.]|[-+]?Inf|NaN)"
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')


def parse_exposition(text: str) -> dict[str, frozenset[str]]:
    """Series names -> label names, from Prometheus text exposition (HTTP headers before it are skipped)."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = set(_LABEL.findall(match.group("labels") or ""))
        out.setdefault(match.group("name"), set()).update(labels)
    return {name: frozenset(labels) for name, labels in out.items()}


_LABEL_VALUE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str) -> list[tuple[str, dict[str, str]]]:
    """Every sample's name and labels (values unescaped only as far as the checks here need)."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is not None:
            out.append((match.group("name"), dict(_LABEL_VALUE.findall(match.group("labels") or ""))))
    return out


def traces_dir() -> Path | None:
    """The recorded vLLM traces (``tests.traces.TRACE_DIR``: the repository's
    ``tests/data/traces/vllm-0.32.0-cpu/``, or ``PD_TRACE_DIR``); None when a ``TRACE_FILES`` file
    is missing."""
    return TRACE_DIR if all((TRACE_DIR / f).is_file() for f in TRACE_FILES) else None


def metrics_from_traces(d: Path) -> dict[str, frozenset[str]]:
    merged: dict[str, set[str]] = {}
    for f in TRACE_FILES:
        for name, labels in parse_exposition((d / f).read_text(encoding="utf-8")).items():
            merged.setdefault(name, set()).update(labels)
    return {name: frozenset(labels) for name, labels in merged.items()}


def format_vendored(metrics: Mapping[str, frozenset[str]]) -> str:
    lines = ["# vLLM 0.32.0 series names and label names, from the traces' metrics-*.txt (generated)."]
    lines += [f"{name} {','.join(sorted(labels))}".rstrip() for name, labels in sorted(metrics.items())]
    return "\n".join(lines) + "\n"


def parse_vendored(text: str) -> dict[str, frozenset[str]]:
    out: dict[str, frozenset[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, labels = line.partition(" ")
        out[name] = frozenset(label for label in labels.split(",") if label)
    return out


def worker_metrics() -> dict[str, MetricSpec]:
    """Every series a real vLLM worker exposes, with its labels plus the scrape's target labels."""
    d = traces_dir()
    raw = metrics_from_traces(d) if d else parse_vendored(VENDORED_VLLM.read_text(encoding="utf-8"))
    return {name: MetricSpec(labels | WORKER_TARGET_LABELS) for name, labels in raw.items()}


def catalog() -> dict[str, MetricSpec]:
    """Everything a dashboard may name."""
    out = {
        name: MetricSpec(spec.labels | PROXY_TARGET_LABELS, spec.values)
        for name, spec in proxy_metrics().items()
    }
    out.update(worker_metrics())
    for name in SYNTHETIC:
        out[name] = MetricSpec(WORKER_TARGET_LABELS)
    return out


# --------------------------------------------------------------------------- live scrapes

_TYPE = re.compile(r"^# TYPE (?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*) (?P<kind>\w+)\s*$")
_SERIES_OF: Final = {
    "histogram": ("_bucket", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count"),
}


def exposed(text: str) -> dict[str, frozenset[str] | None]:
    """Every series name a ``/metrics`` text exposes -> its label names, or None when the family is
    registered (``# TYPE``) but has no sample yet (a labelled metric before its first use)."""
    names: dict[str, frozenset[str] | None] = {}
    for line in text.splitlines():
        match = _TYPE.match(line)
        if match is not None:
            for suffix in _SERIES_OF.get(match.group("kind"), ("",)):
                names.setdefault(match.group("name") + suffix, None)
    for name, labels in parse_exposition(text).items():
        names[name] = labels
    return names


def live_catalog(
    proxy_text: str, worker_texts: Iterable[str], recorded: Mapping[str, MetricSpec] | None = None
) -> dict[str, MetricSpec]:
    """What a dashboard may name, from live scrapes of a proxy and of workers (plus ``recorded``
    worker series, e.g. ``worker_metrics()``). The proxy's series keep the agreed closed sets of
    label values; a series with no sample yet takes the agreed label names (its name is still the
    proxy's own)."""
    agreed = proxy_metrics()
    out: dict[str, MetricSpec] = {}
    for name, labels in exposed(proxy_text).items():
        spec = agreed.get(name)
        own = labels if labels is not None else (spec.labels if spec is not None else frozenset())
        out[name] = MetricSpec(own | PROXY_TARGET_LABELS, spec.values if spec is not None else {})
    for text in worker_texts:
        for name, labels in exposed(text).items():
            before = out.get(name)
            merged = (labels or frozenset()) | WORKER_TARGET_LABELS
            out[name] = MetricSpec(merged | (before.labels if before is not None else frozenset()))
    for name, spec in (recorded or {}).items():
        before = out.get(name)
        out[name] = MetricSpec(spec.labels | (before.labels if before is not None else frozenset()))
    for name in SYNTHETIC:
        out[name] = MetricSpec(WORKER_TARGET_LABELS)
    return out

