"""Real vLLM workers on CPU for end-to-end tests (loaded by the root conftest).

``vllm_cluster`` (session scope) — one prefill, one decode and one aggregated worker serving the tiny
model, started once per test session on first use and stopped at the end::

    @pytest.mark.vllm
    def test_x(vllm_cluster):
        vllm_cluster.prefill_urls[0]     # "http://127.0.0.1:<port>" (kv_producer, --enable-scale-out)
        vllm_cluster.decode_urls[0]      # kv_consumer
        vllm_cluster.aggregated_urls[0]  # no KV connector: the single-server reference
        vllm_cluster.model_dir           # absolute Path of the model folder
        vllm_cluster.served_model_name   # "tiny-llama"
        vllm_cluster.workers             # workers.launcher.Worker records: ports, PIDs, log paths

  It is a :class:`workers.launcher.Cluster`. Workers use the NIXL side channel on 127.0.0.1 and
  vLLM's default 30 s KV lease. Do not stop it or change it; start your own cluster with
  ``workers.launcher.start_cluster`` when a test needs other settings.

``vllm_bin`` (session scope) — the real ``vllm`` executable, for tests that start their own workers.

``tiny_model_dir`` (session scope) — the model folder (``$PD_MODEL_DIR``, else ``.cache/tiny-llama``),
built with :mod:`workers.model` when missing.

Tests marked ``vllm`` without their own ``timeout`` mark get ``timeout(VLLM_TEST_TIMEOUT_S)`` (900 s):
the cluster's start-up (1-4 min on 2 busy cores) counts towards the first test that uses it.

Availability: when ``PD_VLLM_VENV`` is set (``make test`` sets it) a missing vLLM is an error; when it
is not set and the repository's ``.venv-vllm`` is missing, the tests using these fixtures are skipped.

Helpers for worker metrics (Prometheus text from ``GET /metrics``)::

    text = scrape_metrics(vllm_cluster.decode_urls[0])
    metric_value(text, "vllm:nixl_xfer_time_seconds_count")             # sum over matching samples
    metric_value(text, "vllm:num_requests_running", {"engine": "0"})    # only samples with these labels

``metric_value`` returns None when no sample matches (vLLM creates some series on first use).
``scrape_metrics`` is blocking (urllib): fine for worker processes, do not point it at a server running
in the test's own event loop.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from workers import model as tiny_model
from workers.launcher import REPO_ROOT, Cluster, ClusterSettings, LaunchError, start_cluster

STARTUP_TIMEOUT_S = 420.0
VLLM_TEST_TIMEOUT_S = 900.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give real-vLLM tests room for the cluster's start-up unless they set their own timeout."""
    for item in items:
        if item.get_closest_marker("vllm") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(VLLM_TEST_TIMEOUT_S))


def scrape_metrics(url: str, timeout: float = 15.0, attempts: int = 4) -> str:
    """The Prometheus text a worker serves at ``{url}/metrics``.

    A scrape that times out is tried again, up to ``attempts`` times: on a loaded 2-core CI host
    an idle vLLM API server once took more than 10 s to answer one. A refused connection (the
    worker is gone) is not retried."""
    attempt = 1
    while True:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
                body: bytes = resp.read()
            return body.decode()
        except (TimeoutError, urllib.error.URLError) as exc:
            reason = getattr(exc, "reason", None)  # urllib wraps a connect timeout in URLError
            timed_out = isinstance(exc, TimeoutError) or isinstance(reason, TimeoutError)
            if not timed_out or attempt >= attempts:
                raise
        attempt += 1


def metric_value(text: str, sample: str, labels: Mapping[str, str] | None = None) -> float | None:
    """Sum of the samples named ``sample`` whose labels include ``labels``; None when none match."""
    wanted = dict(labels or {})
    values = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in wanted.items())
    ]
    return float(sum(values)) if values else None


def _vllm_bin() -> Path:
    venv = os.environ.get("PD_VLLM_VENV")
    if venv:
        path = Path(venv) / "bin" / "vllm"
        if not path.is_file():
            pytest.fail(
                f"PD_VLLM_VENV={venv} but {path} does not exist: run `make vllm` "
                "(real-vLLM tests never skip when PD_VLLM_VENV is set)",
                pytrace=False,
            )
        return path
    path = REPO_ROOT / ".venv-vllm" / "bin" / "vllm"
    if not path.is_file():
        pytest.skip(f"real vLLM not installed ({path} missing; run `make vllm` or set PD_VLLM_VENV)")
    return path


@pytest.fixture(scope="session")
def vllm_bin() -> Path:
    """The real ``vllm`` executable (fails or skips as described in the module docstring)."""
    return _vllm_bin()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    out = Path(os.environ.get("PD_MODEL_DIR") or REPO_ROOT / ".cache" / "tiny-llama")
    tiny_model.build_model(out)
    return out.absolute()


@pytest.fixture(scope="session")
def vllm_cluster(
    vllm_bin: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    settings = ClusterSettings(
        model=tiny_model_dir,
        prefill=1,
        decode=1,
        aggregated=1,
        vllm_bin=vllm_bin,
        log_dir=tmp_path_factory.mktemp("vllm-logs"),
        startup_timeout=STARTUP_TIMEOUT_S,
    )
    try:
        cluster = start_cluster(settings)
    except LaunchError as exc:
        pytest.fail(f"could not start the real vLLM cluster: {exc}", pytrace=False)
    with cluster:
        _warm_handoff(cluster)
        yield cluster


WARM_DEADLINE_S = 300.0


def _post(url: str, body: dict[str, object], timeout: float) -> dict[str, object] | None:
    req = urllib.request.Request(url + "/inference/v1/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            reply: dict[str, object] = json.loads(resp.read())
            return reply
    except (urllib.error.URLError, TimeoutError, OSError, ValueError):
        return None


def _warm_handoff(cluster: Cluster) -> None:
    """One prefill -> decode hand-off before any test runs: NIXL's first handshake between the
    two workers happens here. On a loaded 2-core host it has timed out (the decode worker then
    answers 500), which belongs to the cluster's start-up, not to whichever test came first.
    Tried until a hand-off works (bounded); the tests then run on a linked pair."""
    p, d = cluster.prefill_urls[0], cluster.decode_urls[0]
    rng = random.Random(0)
    deadline = time.monotonic() + WARM_DEADLINE_S
    for attempt in range(5):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        prompt = [rng.randrange(3, 515) for _ in range(160)]  # more than one 128-token KV block
        sp = {"temperature": 0, "max_tokens": 1}
        reply = _post(p, {"request_id": f"warm-p-{attempt}", "token_ids": prompt, "sampling_params": sp,
                          "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}},
                      timeout=left)
        params = reply.get("kv_transfer_params") if reply is not None else None
        if not isinstance(params, dict):
            continue
        if _post(d, {"request_id": f"warm-d-{attempt}", "token_ids": prompt, "sampling_params": sp,
                     "kv_transfer_params": params}, timeout=max(1.0, deadline - time.monotonic())):
            return
    pytest.fail("the real vLLM prefill and decode workers never completed a KV hand-off "
                f"(logs: {cluster.workers[0].log} and beside it)", pytrace=False)


def vllm_connector() -> aiohttp.TCPConnector:
    """A client connector for sessions that talk to vLLM directly: one connection per request.

    vLLM's uvicorn closes an idle keep-alive connection after 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``).
    A client that reuses a connection as the server closes it fails with ``ServerDisconnectedError``;
    a shorter client-side keep-alive (4 s) narrows that race but does not close it on a loaded
    2-core machine, where the client may notice the end of a response a second after the server
    sent it. Tests are not measuring connection reuse, so they do without it."""
    return aiohttp.TCPConnector(force_close=True)
