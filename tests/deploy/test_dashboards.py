"""The Grafana dashboards and the Prometheus scrape config: every PromQL expression names only metrics
the proxy or a worker exposes, with labels they carry.

Exposed means seen in a live ``/metrics`` scrape: pd-proxy in front of pd-sim workers after scripted
traffic (always), plus a real vLLM worker. The real worker is scraped live in the end-to-end run
(``tests/e2e/test_dashboards_vllm.py``: pd-proxy in front of the session's vLLM cluster, one request
whose KV crosses); here the recorded real vLLM 0.32.0 scrapes (the traces, or their vendored copy)
stand in.
The agreed list of proxy metrics (``metric_catalog.proxy_metrics``) adds the closed sets of label
values, and must itself match what the proxy registers."""

from __future__ import annotations

import re
import shutil
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from deploy.targets import ALERT_RULES, SCRAPE_CONFIG, Endpoints, write_targets
from tests.deploy import dashboards as dash
from tests.deploy import metric_catalog as cat
from tests.deploy.live_scrape import Scrapes, traffic_and_scrape
from tests.deploy.tools import find, run
from tests.fixtures_sim import SimFactory
from tests.traces import TRACE_DIR

FILES = dash.dashboard_files()
QUERIES = [q for f in FILES for q in dash.queries(f)]
KNOWN = cat.catalog()


def test_dashboards_exist_with_unique_uids() -> None:
    uids = [dash.load(f)["uid"] for f in FILES]
    assert len(FILES) >= 4
    assert len(set(uids)) == len(uids)
    assert all(f.stem == uid for f, uid in zip(FILES, uids, strict=True))


@pytest.mark.parametrize("query", QUERIES, ids=str)
def test_expression_names_only_exposed_metrics_and_labels(query: dash.Query) -> None:
    assert dash.problems(query.expr, KNOWN) == []


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("rate(pd_proxy_ttft_second_bucket[5m])", "exposed by neither"),  # typo in the name
        ("pd_proxy_ttft_seconds", "exposed by neither"),  # a histogram's bare name is no series
        ("rate(vllm:nixl_num_kv_expired_reqs[5m])", "exposed by neither"),  # counter without _total
        ('pd_proxy_requests_total{result="ok"}', "no label 'result'"),
        ('pd_proxy_stage_seconds_count{stage="transfer"}', "never 'transfer'"),
        ('pd_proxy_aborts_total{source=~"client_call|timeout"}', "never 'timeout'"),
        ("sum by (pool) (rate(pd_proxy_requests_total[$__rate_interval]))", "has no ['pool']"),
        ("sum by (le) (rate(pd_proxy_ttft_seconds_sum[5m]))", "has no ['le']"),
        ("sum(rate(pd_proxy_requests_total[5m])", "does not parse"),
    ],
)
def test_checker_reports_mistakes(expr: str, expected: str) -> None:
    found = dash.problems(expr, KNOWN)
    assert any(expected in p for p in found), found


def test_checker_accepts_grafana_variables_and_target_labels() -> None:
    expr = 'sum by (pool, instance) (rate(vllm:num_preemptions_total{pool=~"$pool"}[$__rate_interval]))'
    assert dash.problems(expr, KNOWN) == []


def test_dashboards_cover_every_required_view() -> None:
    """Issue 7 item 5: TTFT/ITL percentiles, TTFT by stage, KV leases and aborts, errors and health by
    pool and worker, and the workers' queue, KV usage, NIXL transfer time and expired KV."""
    named = {s.name for q in QUERIES for s in dash.selectors(dash.parse(q.expr))}
    required = {
        "pd_proxy_ttft_seconds_bucket",
        "pd_proxy_itl_seconds_bucket",
        "pd_proxy_tpot_seconds_bucket",
        "pd_proxy_e2e_seconds_bucket",
        "pd_proxy_stage_seconds_bucket",
        "pd_proxy_stage_seconds_sum",
        "pd_proxy_kv_leases_open",
        "pd_proxy_kv_lease_duration_seconds_bucket",
        "pd_proxy_kv_leases_closed_total",
        "pd_proxy_aborts_total",
        "pd_proxy_abort_fanout_total",
        "pd_proxy_worker_healthy",
        "pd_proxy_circuit_state",
        "pd_proxy_upstream_errors_total",
        "pd_proxy_upstream_requests_total",
        "pd_proxy_inflight_requests",
        "pd_proxy_prefill_missing_kv_params_total",
        "pd_proxy_decode_only_total",
        "pd_proxy_suspect_no_transfer_total",
        "pd_proxy_retries_total",
        "pd_proxy_migrations_total",
        "pd_proxy_queue_rejections_total",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:nixl_xfer_time_seconds_bucket",
        "vllm:nixl_num_kv_expired_reqs_total",
        "vllm:nixl_num_failed_transfers_total",
        "pd_proxy_first_token_mismatch_total",
        "pd_proxy_decode_local_prefill_tokens_total",
        "pd_proxy_decode_failed_pulls_total",
    }
    assert required - named == set()


LATENCY = dash.DASHBOARDS / "pd-proxy-latency.json"
TTFT_STAGES = {"queue", "prefill", "handoff", "decode_first_token"}
ALL_STAGES = cat.proxy_metrics()["pd_proxy_stage_seconds_sum"].values["stage"]


def _panels(path: Path) -> list[dict[str, Any]]:
    return [p for p in dash.load(path)["panels"] if p["type"] != "row"]


def _stages(expr: str) -> set[str]:
    """The stages of pd_proxy_stage_seconds an expression reads (every stage when it names none)."""
    found: set[str] = set()
    for sel in dash.selectors(dash.parse(expr)):
        if not sel.name.startswith("pd_proxy_stage_seconds"):
            continue
        stage = ALL_STAGES
        for label, op, value in sel.matchers:
            if label != "stage":
                continue
            if op == "Equal":
                stage = frozenset({value})
            elif op == "NotEqual":
                stage = stage - {value}
            elif op == "Re":  # a plain alternation narrows; any other regex is taken as every stage
                stage = frozenset(dash._alternatives(value) or stage)
            else:  # NotRe
                stage = stage - set(dash._alternatives(value) or ())
        found |= stage
    return found


def test_stage_times_against_client_ttft_take_the_stages_up_to_the_decode_first_token() -> None:
    """Panels that stack or divide stage times against the client's TTFT take queue, prefill, handoff
    and decode_first_token only: first_to_second (P's token to the next write) overlaps handoff and
    decode_first_token, and decode_stream comes after the first token."""
    checked = 0
    for panel in _panels(LATENCY):
        exprs = [t["expr"] for t in panel["targets"]]
        if not any("pd_proxy_ttft_seconds_sum" in e for e in exprs):
            continue
        for expr in exprs:
            if "pd_proxy_stage_seconds_sum" in expr:
                checked += 1
                assert _stages(expr) == TTFT_STAGES, (panel["title"], expr)
        # and the description tells a reader that a stream with P's token adds up differently
        assert "first_to_second" in panel["description"], panel["title"]
    assert checked == 2  # the stacked means and the shares


def test_first_to_second_has_its_percentiles_and_the_mismatches_their_rate() -> None:
    exprs = [t["expr"] for p in _panels(LATENCY) for t in p["targets"]]
    quantiles = {
        e.split(",", 1)[0].removeprefix("histogram_quantile(")
        for e in exprs
        if e.startswith("histogram_quantile(") and _stages(e) == {"first_to_second"}
    }
    assert {"0.5", "0.99"} <= quantiles
    assert any(
        re.fullmatch(r"sum \(rate\(pd_proxy_first_token_mismatch_total\{[^}]*\}\[\$__rate_interval\]\)\)", e)
        for e in exprs
    )


def test_the_stage_reader_follows_matchers() -> None:
    assert _stages('pd_proxy_stage_seconds_sum{stage!="decode_stream"}') == ALL_STAGES - {"decode_stream"}
    assert _stages('pd_proxy_stage_seconds_sum{stage=~"queue|prefill"}') == {"queue", "prefill"}
    assert _stages('pd_proxy_stage_seconds_sum{stage="first_to_second"}') == {"first_to_second"}
    assert _stages('pd_proxy_stage_seconds_sum{stage!~"queue|prefill"}') == ALL_STAGES - {"queue", "prefill"}
    assert _stages('pd_proxy_stage_seconds_sum{stage=~"q.*"}') == ALL_STAGES
    assert _stages("rate(pd_proxy_ttft_seconds_sum[5m])") == set()


def test_panels_are_well_formed() -> None:
    for f in FILES:
        d = dash.load(f)
        names = [v["name"] for v in d["templating"]["list"]]
        assert names[0] == "datasource", f.name
        assert d["templating"]["list"][0]["query"] == "prometheus"
        ids = []
        for panel in d["panels"]:
            ids.append(panel["id"])
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, (f.name, panel["title"])
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            refs = [t["refId"] for t in panel["targets"]]
            assert panel["targets"] and len(set(refs)) == len(refs), (f.name, panel["title"])
            assert all(t["datasource"] == panel["datasource"] for t in panel["targets"])
        assert len(set(ids)) == len(ids), f.name


def test_provisioning_points_at_the_dashboards() -> None:
    base = dash.DASHBOARDS.parent / "provisioning"
    providers = yaml.safe_load((base / "dashboards" / "pd-proxy.yml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == ["/var/lib/grafana/dashboards/pd-proxy"]
    sources = yaml.safe_load((base / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [(s["type"], s["url"]) for s in sources] == [("prometheus", "${PROMETHEUS_URL}")]
    compose = (cat.REPO / "deploy" / "compose" / "docker-compose.yml").read_text()
    assert "../grafana/dashboards:/var/lib/grafana/dashboards/pd-proxy:ro" in compose


def test_vendored_worker_metrics_match_the_traces() -> None:
    traces = cat.traces_dir()
    assert traces is not None, (
        f"the recorded vLLM traces are missing: expected {', '.join(cat.TRACE_FILES)} in {TRACE_DIR}")
    vendored = cat.VENDORED_VLLM.read_text(encoding="utf-8")
    assert vendored == cat.format_vendored(cat.metrics_from_traces(traces))


def test_scrape_config_discovers_proxy_and_workers_from_files() -> None:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"pd-proxy", "vllm"}
    assert jobs["pd-proxy"]["file_sd_configs"][0]["files"] == ["targets/proxy.json"]
    assert jobs["vllm"]["file_sd_configs"][0]["files"] == ["targets/workers.json"]
    assert all(j["metrics_path"] == "/metrics" for j in jobs.values())


PROMTOOL = find("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_scrape_config_and_targets(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    shutil.copy(SCRAPE_CONFIG, tmp_path / "prometheus.yml")
    shutil.copy(ALERT_RULES, tmp_path / ALERT_RULES.name)
    write_targets(
        tmp_path / "targets",
        Endpoints(["http://127.0.0.1:8000"], ["http://127.0.0.1:8100"], ["http://127.0.0.1:8200"]),
    )
    result = run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr  # both targets files found
    assert "2 rules found" in result.stdout  # the alert rules file, next to the config


def test_alert_rules_are_loaded_and_name_only_exposed_metrics() -> None:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert config["rule_files"] == [ALERT_RULES.name]
    rules = [r for g in yaml.safe_load(ALERT_RULES.read_text())["groups"] for r in g["rules"]]
    metric = {"PdProxyDecodeLocalPrefill": "pd_proxy_decode_local_prefill_tokens_total",
              "PdProxyDecodeFailedPulls": "pd_proxy_decode_failed_pulls_total"}
    assert {r["alert"] for r in rules} == set(metric)
    for rule in rules:
        assert dash.problems(rule["expr"], KNOWN) == [], rule["alert"]
        assert metric[rule["alert"]] in rule["expr"]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_the_alert_rules() -> None:
    assert PROMTOOL is not None
    result = run([PROMTOOL, "check", "rules", str(ALERT_RULES)])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_parses_every_dashboard_expression(tmp_path: Path) -> None:
    """Prometheus's own parser agrees with promql-parser on every expression."""
    assert PROMTOOL is not None
    rules = [{"record": f"dashboard:e{i}", "expr": dash.substitute(q.expr)} for i, q in enumerate(QUERIES)]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = run([PROMTOOL, "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout


# --------------------------------------------------------------------------- live scrapes


def all_problems(known: Mapping[str, cat.MetricSpec]) -> list[str]:
    return [f"{q}: {p}" for q in QUERIES for p in dash.problems(q.expr, known)]


def worker_names_used() -> set[str]:
    named = {s.name for q in QUERIES for s in dash.selectors(dash.parse(q.expr))}
    return {n for n in named if not n.startswith("pd_proxy_") and n not in cat.SYNTHETIC}


@pytest.fixture
async def sim_scrapes(sim_factory: SimFactory) -> AsyncIterator[Scrapes]:
    """pd-proxy (in-process, real sockets) in front of a pd-sim prefill and decode worker, after
    scripted traffic; the scrapes of all three."""
    from proxy.config.settings import ProxySettings  # noqa: PLC0415
    from proxy.http.app import build_app  # noqa: PLC0415

    p = await sim_factory(role="prefill", zero_latency=True)
    d = await sim_factory(role="decode", zero_latency=True)
    runner = web.AppRunner(build_app(ProxySettings(prefill_urls=(p.url,), decode_urls=(d.url,))),
                           handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(int(a[1]) for a in runner.addresses if isinstance(a, tuple))
    try:
        yield await traffic_and_scrape(f"http://127.0.0.1:{port}", [p.url, d.url], fail_prefill=p.url)
    finally:
        await runner.cleanup()


async def test_every_dashboard_metric_is_exposed_by_the_live_proxy_or_a_worker(sim_scrapes: Scrapes) -> None:
    # Workers: the live pd-sim scrapes, and a real vLLM worker's recorded scrape (the fallback for
    # the live one of the end-to-end run below).
    known = cat.live_catalog(sim_scrapes.proxy, sim_scrapes.workers, cat.worker_metrics())
    assert all_problems(known) == []


async def test_every_agreed_proxy_metric_is_registered_by_the_proxy(sim_scrapes: Scrapes) -> None:
    live = cat.exposed(sim_scrapes.proxy)
    assert set(cat.proxy_metrics()) - set(live) == set()
    # label names as the proxy really emits them (where the traffic created a series)
    for name, spec in cat.proxy_metrics().items():
        labels = live[name]
        if labels is not None:
            assert labels == spec.labels, name
    # and the traffic reached the series the health dashboard's rows need
    for name in ("pd_proxy_upstream_errors_total", "pd_proxy_aborts_total", "pd_proxy_abort_fanout_total",
                 "pd_proxy_circuit_state", "pd_proxy_retries_total", "pd_proxy_stage_seconds_bucket"):
        assert live[name] is not None, name


async def test_pd_sim_exposes_the_worker_metrics_the_dashboards_use(sim_scrapes: Scrapes) -> None:
    sim: set[str] = set()
    for text in sim_scrapes.workers:
        sim |= set(cat.exposed(text))
    # What pd-sim does not simulate (no preemption, no KV-fetch stages, no NIXL notifications):
    # those panels stay empty against pd-sim and are checked against real vLLM only.
    assert worker_names_used() - sim == {
        "vllm:num_preemptions_total",
        "vllm:num_requests_kv_fetch_by_stage",
        "vllm:nixl_num_failed_notifications_total",
        "vllm:nixl_num_notifications_after_expiry_total",
    }


def test_live_catalog_reports_what_the_scrape_lacks() -> None:
    proxy_text = "# TYPE pd_proxy_requests_total counter\npd_proxy_requests_total{outcome=\"ok\"} 1.0\n"
    known = cat.live_catalog(proxy_text, ["# TYPE vllm:num_requests_running gauge\n"])
    assert dash.problems("sum(rate(pd_proxy_requests_total[5m]))", known) == []
    assert dash.problems("vllm:num_requests_running", known) == []  # registered, no sample yet
    assert any("exposed by neither" in p for p in dash.problems("pd_proxy_ttft_seconds_bucket", known))
    assert any("no label 'pool'" in p for p in dash.problems('pd_proxy_requests_total{pool="x"}', known))


# --------------------------------------------------------------------------- several deployments

# Which dashboard variable filters each kind of series, so that several deployments (namespaces, or jobs
# outside Kubernetes) and models can share one Prometheus.
FILTERS = {
    "pd_proxy_": {"namespace": "$namespace", "job": "$job"},
    "vllm:": {"namespace": "$namespace", "model_name": "$model"},
    "up": {"namespace": "$namespace"},
}
_VAR_IN_VALUE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def raw_matchers(expr: str) -> list[dash.Selector]:
    """Selectors with dashboard variables kept by name (``$job`` -> ``__var_job__``)."""
    def name(m: re.Match[str]) -> str:
        return m.group(0) if m.group(0).startswith("$__") else f"__var_{m.group(1)}__"

    return dash.selectors(dash.parse(_VAR_IN_VALUE.sub(name, expr)))


def filters_of(name: str) -> dict[str, str]:
    if name == "up":
        return FILTERS["up"]
    return next(f for prefix, f in FILTERS.items() if name.startswith(prefix) and prefix != "up")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_dashboards_filter_by_namespace_job_and_model(path: Path) -> None:
    """Every series a panel reads is narrowed by the dashboard's namespace variable, and by job (the
    proxy's) or model (the workers' model_name); each variable offers All (a missing label matches)."""
    d = dash.load(path)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    for name in ("namespace", "job", "model"):
        var = variables[name]
        assert var["type"] == "query" and var["includeAll"] is True and var["allValue"] == ".*", name
    missing = []
    for q in dash.queries(path):
        if not q.where.startswith("panel"):
            continue
        for sel in raw_matchers(q.expr):
            have = {label: value for label, op, value in sel.matchers if op == "Re"}
            for label, var in filters_of(sel.name).items():
                if have.get(label) != f"__var_{var[1:]}__":
                    missing.append(f"{q}: {sel.name} not filtered by {label}=~\"{var}\"")
    assert missing == []


def test_the_filter_check_catches_an_unfiltered_series() -> None:
    (sel,) = raw_matchers('sum(rate(pd_proxy_requests_total{job=~"$job"}[$__rate_interval]))')
    assert dict((label, value) for label, _, value in sel.matchers) == {"job": "__var_job__"}
    assert filters_of(sel.name) == FILTERS["pd_proxy_"] and filters_of("up") == FILTERS["up"]
