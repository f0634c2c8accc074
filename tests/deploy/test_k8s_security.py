"""deploy/k8s security defaults, on the manifests as kustomize renders them: keys only from Secrets,
NetworkPolicies around the vLLM pods (evaluated here for every pair of pods and ports that matters),
non-root workers with a read-only root filesystem, and the service-account token mounted only where
EndpointSlice discovery needs it."""

from __future__ import annotations

import base64
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from tests.deploy.metric_catalog import REPO
from tests.deploy.test_k8s import (
    K8S,
    K8S_VERSIONS,
    KUBECTL,
    OVERLAYS,
    Obj,
    build,
    by_kind,
    container,
    env_of,
    needs_kubectl,
)
from tests.deploy.tools import run

pytestmark = needs_kubectl

WORKERS = ("pd-prefill", "pd-decode")
DISCOVERY = "endpointslice-discovery"
KEYS = K8S / "components" / "proxy-keys"
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD", re.IGNORECASE)
SECRET_FLAGS = ("--api-key", "--admin-key", "--upstream-api-key")


def render(kustomization_dir: Path) -> tuple[Obj, ...]:
    assert KUBECTL is not None
    result = run([KUBECTL, "kustomize", str(kustomization_dir)])
    assert result.returncode == 0, result.stderr
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def build_with(tmp_path: Path, overlay: str, *components: str | Path) -> tuple[Obj, ...]:
    """An overlay plus components (names under deploy/k8s/components, or directories), as a user's
    own kustomization would add them."""
    root = tmp_path / "user"
    root.mkdir(exist_ok=True)
    paths = [c if isinstance(c, Path) else K8S / "components" / c for c in components]
    rel = [os.path.relpath(p, root) for p in (K8S / "overlays" / overlay, *paths)]
    (root / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{rel[0]}]\n" + (f"components: [{', '.join(rel[1:])}]\n" if paths else "")
    )
    return render(root)


def overlay_components(overlay: str) -> list[str]:
    """The names of the components an overlay includes."""
    data = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    return [Path(c).name for c in data.get("components") or []]


def pod_spec(deployment: Obj) -> Obj:
    spec: Obj = deployment["spec"]["template"]["spec"]
    return spec


# --- 1. keys only from Secrets ------------------------------------------------------------------


def literal_secrets(objs: tuple[Obj, ...]) -> list[str]:
    """Env entries that look like secrets but carry a literal value, and secret flags on a command line."""
    found = []
    for d in by_kind(objs, "Deployment").values():
        for c in pod_spec(d)["containers"]:
            for e in c.get("env", []):
                if SECRET_NAME.search(e["name"]) and "value" in e:
                    found.append(f"{d['metadata']['name']}: env {e['name']} has a literal value")
            words = [*c.get("command", []), *c.get("args", [])]
            found += [f"{d['metadata']['name']}: {w}" for w in words if w.split("=")[0] in SECRET_FLAGS]
    return found


def proxy_key_refs(objs: tuple[Obj, ...]) -> dict[str, Obj]:
    env = env_of(container(by_kind(objs, "Deployment")["pd-proxy"], "pd-proxy"))
    names = ("PD_PROXY_API_KEY", "PD_PROXY_ADMIN_KEY")
    return {name: env[name]["valueFrom"]["secretKeyRef"] for name in names}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_proxy_keys_come_from_a_secret(tmp_path: Path, overlay: str) -> None:
    for objs in (build(f"overlays/{overlay}"), build_with(tmp_path, overlay, DISCOVERY)):
        refs = proxy_key_refs(objs)
        assert refs["PD_PROXY_API_KEY"] == {"name": "pd-proxy-keys", "key": "api-key"}  # required
        assert refs["PD_PROXY_ADMIN_KEY"] == {"name": "pd-proxy-keys", "key": "admin-key", "optional": True}
        assert literal_secrets(objs) == []
        assert by_kind(objs, "Secret") == {}, "no Secret (so no key) is committed in the manifests"


def test_literal_secret_check_finds_literals() -> None:
    objs = build("overlays/gpu")
    proxy = yaml.safe_load(yaml.safe_dump(by_kind(objs, "Deployment")["pd-proxy"]))
    c = container(proxy, "pd-proxy")
    c["env"].append({"name": "PD_PROXY_API_KEY", "value": "k"})
    c["args"] += ["--admin-key=a"]
    assert len(literal_secrets((proxy,))) == 2


def deploy_copy(tmp_path: Path, keys_env: str | None) -> Path:
    """deploy/k8s (and the dashboards it packs) copied, with ``keys_env`` as the keys component's
    keys.env (none when None): what a user's checkout holds after following deploy/README.md."""
    root = tmp_path / "deploy"
    for part in ("k8s", "grafana"):
        shutil.copytree(K8S.parent / part, root / part, ignore=shutil.ignore_patterns("keys.env"))
    if keys_env is not None:
        (root / "k8s" / "components" / "proxy-keys" / "keys.env").write_text(keys_env)
    return root / "k8s"


def enable_keys_component(k8s: Path, overlay: str) -> Path:
    """Uncomment the proxy-keys component in a copied overlay, as its comment says to."""
    path = k8s / "overlays" / overlay / "kustomization.yaml"
    text = path.read_text()
    commented = "# components:\n#   - ../../components/proxy-keys\n"
    in_list = "  # - ../../components/proxy-keys\n"  # an overlay that has components already (gpu)
    assert commented in text or in_list in text
    text = text.replace(commented, "components:\n  - ../../components/proxy-keys\n")
    path.write_text(text.replace(in_list, "  - ../../components/proxy-keys\n"))
    return path.parent


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keys_component_generates_the_secret_the_proxy_reads(tmp_path: Path, overlay: str) -> None:
    k8s = deploy_copy(tmp_path, "api-key=client-Kx81\nadmin-key=admin-Qz27\n")
    objs = render(enable_keys_component(k8s, overlay))
    (secret,) = by_kind(objs, "Secret").values()
    kubernetes_validate.validate(secret, K8S_VERSIONS[-1], strict=True)
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert data == {"api-key": "client-Kx81", "admin-key": "admin-Qz27"}
    proxy = by_kind(objs, "Deployment")["pd-proxy"]
    assert secret["metadata"]["namespace"] == proxy["metadata"]["namespace"]
    # The generated name carries a hash of the keys (a new key rolls the pods); the references follow it.
    assert secret["metadata"]["name"].startswith("pd-proxy-keys-")
    assert {r["name"] for r in proxy_key_refs(objs).values()} == {secret["metadata"]["name"]}


def test_keys_component_has_no_default_key(tmp_path: Path) -> None:
    """Without keys.env the build fails; a copy of the example gives a Secret with no api-key (the
    proxy's pods then do not start) rather than a known key."""
    assert KUBECTL is not None
    assert "/deploy/k8s/components/proxy-keys/keys.env" in (REPO / ".gitignore").read_text().splitlines()
    k8s = deploy_copy(tmp_path, None)
    overlay = enable_keys_component(k8s, "gpu")
    result = run([KUBECTL, "kustomize", str(overlay)])
    assert result.returncode != 0 and "keys.env" in result.stderr
    keys = k8s / "components" / "proxy-keys"
    (keys / "keys.env").write_text((keys / "keys.env.example").read_text())
    (secret,) = by_kind(render(overlay), "Secret").values()
    assert "api-key" not in secret.get("data", {})


# --- 2. NetworkPolicies -------------------------------------------------------------------------


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions); the empty selector selects everything."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: Mapping[str, str]
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)  # named container ports


def peer_matches(peer: Obj, src: Pod, policy_namespace: str) -> bool:
    assert "ipBlock" not in peer, "ipBlock peers are not modelled by this check"
    ns_selector, pod_selector = peer.get("namespaceSelector"), peer.get("podSelector")
    if ns_selector is None:
        in_namespace = src.namespace == policy_namespace
    else:
        in_namespace = selects(ns_selector, src.namespace_labels)
    return in_namespace and (pod_selector is None or selects(pod_selector, src.labels))


def port_matches(rule_ports: list[Obj] | None, dst: Pod, port: int) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in p:
            return True
        first: int | str = p["port"]
        if isinstance(first, str):
            if dst.ports.get(first) == port:
                return True
        else:
            last: int = p.get("endPort", first)
            if first <= port <= last:
                return True
    return False


def ingress_allowed(policies: list[Obj], src: Pod, dst: Pod, port: int) -> bool:
    """Whether ``src`` may open a TCP connection to ``dst``:``port`` (NetworkPolicy semantics: a pod no
    ingress policy selects accepts everything; otherwise the union of the selecting policies' rules)."""
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == dst.namespace
        and selects(p["spec"]["podSelector"], dst.labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            if (not peers or any(peer_matches(f, src, policy["metadata"]["namespace"]) for f in peers)) and (
                port_matches(rule.get("ports"), dst, port)
            ):
                return True
    return False


def pod_of(deployment: Obj, namespace_labels: Mapping[str, str]) -> Pod:
    containers = pod_spec(deployment)["containers"]
    ports = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])}
    return Pod(
        deployment["metadata"]["name"],
        deployment["metadata"]["namespace"],
        deployment["spec"]["template"]["metadata"]["labels"],
        namespace_labels,
        ports,
    )


UCX_PORTS = (1024, 20000, 40000, 65535)  # UCX's listening ports are random unless pinned


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_fence_the_workers(overlay: str) -> None:
    objs = build(f"overlays/{overlay}")
    policies = list(by_kind(objs, "NetworkPolicy").values())
    for policy in policies:
        kubernetes_validate.validate(policy, K8S_VERSIONS[0], strict=True)
    deployments = by_kind(objs, "Deployment")
    ns = deployments["pd-proxy"]["metadata"]["namespace"]
    ns_labels = {"kubernetes.io/metadata.name": ns}
    proxy, prefill, decode = (pod_of(deployments[n], ns_labels) for n in ("pd-proxy", *WORKERS))
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    prometheus = Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}, monitoring)
    strangers = [
        Pod("other-app", ns, {"app.kubernetes.io/name": "other"}, ns_labels),
        Pod("unlabelled", ns, {}, ns_labels),
        # The proxy's and the workers' labels, but in another namespace.
        Pod("fake-proxy", "evil", proxy.labels, {"kubernetes.io/metadata.name": "evil"}),
        Pod("fake-decode", "evil", decode.labels, {"kubernetes.io/metadata.name": "evil"}),
        # Prometheus's labels outside the monitoring namespace.
        Pod("fake-prometheus", "default", prometheus.labels, {"kubernetes.io/metadata.name": "default"}),
    ]
    http = prefill.ports["http"]
    assert http == decode.ports["http"] == 8000
    prefill_env = env_of(container(deployments["pd-prefill"], "vllm"))
    side_channel = int(prefill_env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
    assert prefill.ports["nixl"] == side_channel

    def allowed(src: Pod, dst: Pod, port: int) -> bool:
        return ingress_allowed(policies, src, dst, port)

    for worker in (prefill, decode):
        # HTTP: the proxy and Prometheus only; never a worker, a stranger or a look-alike.
        assert allowed(proxy, worker, http) and allowed(prometheus, worker, http), worker.name
        for src in (prefill, decode, *strangers):
            assert not allowed(src, worker, http), (src.name, worker.name)
        # Nothing else reaches a worker's other ports, the proxy and Prometheus included.
        for src in (proxy, prometheus, *strangers):
            for port in (side_channel, *UCX_PORTS):
                assert not allowed(src, worker, port), (src.name, worker.name, port)
    # KV transfer: decode -> prefill's side channel and UCX ports; UCX both ways (either side may
    # open the TCP connection).
    for port in (side_channel, *UCX_PORTS):
        assert allowed(decode, prefill, port), port
        assert allowed(prefill, decode, port), port
    # KV-cache events: the proxy subscribes to the prefill pods' PUB and replay ports; nobody else
    # outside the pools does, and decode pods publish none.
    events = (prefill.ports["kv-events"], prefill.ports["kv-replay"])
    assert events == (5557, 5558)
    for port in events:
        assert allowed(proxy, prefill, port), port
        assert not allowed(proxy, decode, port), port
        for src in (prometheus, *strangers):
            assert not allowed(src, prefill, port), (src.name, port)
    # A pool never reaches its own kind (one prefill pod has no business with another's KV).
    assert not allowed(prefill, prefill, side_channel) and not allowed(decode, decode, 40000)
    # The proxy itself is not fenced (clients reach it from anywhere, with its key).
    assert allowed(strangers[0], proxy, proxy.ports["http"])


def test_policy_evaluator_semantics() -> None:
    """The evaluator used above: no policy allows all, a deny-all policy denies, rules add up."""
    dst = Pod("d", "ns", {"app": "x"}, ports={"http": 80})
    src = Pod("s", "ns", {"role": "client"})
    other_ns = Pod("s2", "other", {"role": "client"}, {"team": "a"})
    deny = {"metadata": {"namespace": "ns"}, "spec": {"podSelector": {"matchLabels": {"app": "x"}}}}
    allow = {
        "metadata": {"namespace": "ns"},
        "spec": {
            "podSelector": {},
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {"role": "client"}}}],
                 "ports": [{"port": "http"}]},
                {"from": [{"namespaceSelector": {"matchLabels": {"team": "a"}}}],
                 "ports": [{"port": 10, "endPort": 20}]},
            ],
        },
    }
    assert ingress_allowed([], src, dst, 80)
    assert not ingress_allowed([deny], src, dst, 80)
    both = [deny, allow]
    assert ingress_allowed(both, src, dst, 80) and not ingress_allowed(both, src, dst, 81)
    assert not ingress_allowed(both, other_ns, dst, 80)
    assert ingress_allowed(both, other_ns, dst, 15) and not ingress_allowed(both, other_ns, dst, 21)


# --- 3. restricted securityContext --------------------------------------------------------------

# Where vLLM and the libraries under it write: HOME (~/.cache, ~/.config, ~/.triton, ~/.nv), the caches
# named by these variables, /tmp and /dev/shm.
WRITTEN_ENV = ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HF_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR",
               "TORCHINDUCTOR_CACHE_DIR")


def restricted_problems(deployment: Obj, name: str) -> list[str]:
    spec = pod_spec(deployment)
    pod_sc = spec.get("securityContext", {})
    c = container(deployment, name)
    sc = c.get("securityContext", {})
    problems = []
    if pod_sc.get("runAsNonRoot") is not True:
        problems.append("runAsNonRoot")
    if not isinstance(pod_sc.get("runAsUser"), int) or pod_sc["runAsUser"] == 0:
        problems.append("runAsUser")
    if (sc.get("seccompProfile") or pod_sc.get("seccompProfile")) != {"type": "RuntimeDefault"}:
        problems.append("seccompProfile")
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append("allowPrivilegeEscalation")
    if sc.get("readOnlyRootFilesystem") is not True:
        problems.append("readOnlyRootFilesystem")
    if sc.get("capabilities") != {"drop": ["ALL"]}:
        problems.append("capabilities")
    if sc.get("privileged"):
        problems.append("privileged")
    return problems


def writable(deployment: Obj, name: str, path: str) -> bool:
    """``path`` lies under a writable emptyDir (or PVC) mounted in the container."""
    volumes = {v["name"]: v for v in pod_spec(deployment).get("volumes", [])}
    for m in container(deployment, name).get("volumeMounts", []):
        root = m["mountPath"].rstrip("/")
        if (path == root or path.startswith(root + "/")) and not m.get("readOnly"):
            v = volumes[m["name"]]
            if "emptyDir" in v or "persistentVolumeClaim" in v:
                return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_restricted(overlay: str) -> None:
    deployments = by_kind(build(f"overlays/{overlay}"), "Deployment")
    assert restricted_problems(deployments["pd-proxy"], "pd-proxy") == []
    # the read-only root needs a writable temporary directory: --workers N keeps its processes' shared
    # metrics files there (tempfile.mkdtemp: TMPDIR, else /tmp)
    proxy_env = env_of(container(deployments["pd-proxy"], "pd-proxy"))
    tmpdir = proxy_env["TMPDIR"]["value"] if "TMPDIR" in proxy_env else "/tmp"
    assert writable(deployments["pd-proxy"], "pd-proxy", tmpdir)
    for name in WORKERS:
        d = deployments[name]
        assert restricted_problems(d, "vllm") == [], name
        env = env_of(container(d, "vllm"))
        paths = [env[k]["value"] for k in WRITTEN_ENV]
        assert all(writable(d, "vllm", p) for p in (*paths, "/tmp", "/dev/shm")), (name, paths)
        assert not writable(d, "vllm", "/usr/local/lib")  # the check can fail
        assert env["USER"]["value"]  # getpass.getuser() for a uid with no passwd entry
        shm = next(v for v in pod_spec(d)["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory"


# --- 5. service-account token only with discovery -----------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_account_token_only_with_discovery(tmp_path: Path, overlay: str) -> None:
    plain = build(f"overlays/{overlay}")
    with_discovery = DISCOVERY in overlay_components(overlay)  # the GPU overlay includes it
    for d in by_kind(plain, "Deployment").values():
        token = with_discovery and d["metadata"]["name"] == "pd-proxy"
        assert pod_spec(d).get("automountServiceAccountToken") is token, d["metadata"]["name"]
    (account,) = by_kind(plain, "ServiceAccount").values()
    assert account.get("automountServiceAccountToken") is False

    discovery = build_with(tmp_path, overlay, DISCOVERY)
    deployments = by_kind(discovery, "Deployment")
    proxy = deployments["pd-proxy"]
    kubernetes_validate.validate(proxy, K8S_VERSIONS[-1], strict=True)
    assert pod_spec(proxy)["automountServiceAccountToken"] is True
    assert pod_spec(proxy)["serviceAccountName"] == account["metadata"]["name"]
    for name in WORKERS:
        assert pod_spec(deployments[name])["automountServiceAccountToken"] is False
    # What the token allows stays read-only.
    (role,) = by_kind(discovery, "Role").values()
    assert {v for rule in role["rules"] for v in rule["verbs"]} == {"get", "list", "watch"}
    assert [r["resources"] for r in role["rules"]] == [["endpointslices"]]
    assert by_kind(discovery, "ClusterRole") == {} and by_kind(discovery, "ClusterRoleBinding") == {}
