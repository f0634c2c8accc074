"""Pool membership from Kubernetes EndpointSlices selected by label (optional extra ``k8s``).

Only slices made by the EndpointSlice controller count: anyone who may create EndpointSlices in
the namespace could otherwise point the pool at any address. A watch resumes from its resource
version and lists again on 410 or an error, after a backoff; every API call has a timeout."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from proxy.fleet.membership import Pools
from proxy.fleet.retry import RetryPolicy

log = logging.getLogger(__name__)

MANAGED_BY_LABEL: Final = "endpointslice.kubernetes.io/managed-by"
CONTROLLER: Final = "endpointslice-controller.k8s.io"
"""Only slices the EndpointSlice controller made (this label value) give workers."""


def controller_managed(raw: Mapping[str, Any]) -> bool:
    """Whether one EndpointSlice (its JSON) was made by the EndpointSlice controller."""
    labels = (raw.get("metadata") or {}).get("labels") or {}
    return labels.get(MANAGED_BY_LABEL) == CONTROLLER


@dataclass(frozen=True, slots=True)
class SliceSelector:
    pool: str
    namespace: str
    label_selector: str
    port: str | int
    """The port's name in the EndpointSlice (e.g. ``http``), or a number to use as is."""
    scheme: str = "http"

    @property
    def source(self) -> str:
        return f"k8s:{self.namespace}/{self.label_selector}"


def _host(address: str) -> str:
    try:
        if isinstance(ipaddress.ip_address(address), ipaddress.IPv6Address):
            return f"[{address}]"
    except ValueError:
        pass  # an FQDN address type
    return address


def slice_urls(raw: Mapping[str, Any], port: str | int, scheme: str = "http") -> set[str]:
    """The URLs of the ready endpoints of one EndpointSlice (absent ``ready`` means ready)."""
    if isinstance(port, int):
        number: int | None = port
    else:
        number = next((p.get("port") for p in raw.get("ports") or [] if p.get("name") == port), None)
    if not isinstance(number, int):
        return set()
    urls: set[str] = set()
    for endpoint in raw.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        for address in endpoint.get("addresses") or []:
            urls.add(f"{scheme}://{_host(address)}:{number}")
    return urls


async def api_client_from_environment(kubeconfig: str | None = None) -> client.ApiClient:
    """In a pod: the service account; elsewhere: ``kubeconfig`` (or ``~/.kube/config``)."""
    configuration = client.Configuration()
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            return client.ApiClient(configuration)
        except config.ConfigException:
            pass
    await config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    return client.ApiClient(configuration)


class EndpointSliceSource:
    def __init__(self, pools: Pools, selector: SliceSelector, api_client: client.ApiClient, *,
                 watch_seconds: int = 300, request_timeout: float = 30.0,
                 backoff: RetryPolicy | None = None, rng: random.Random | None = None) -> None:
        if selector.pool not in pools:
            raise ValueError(f"unknown pool {selector.pool!r}")
        self.pools = pools
        self.selector = selector
        self.api_client = api_client
        self.api = client.DiscoveryV1Api(api_client)
        self.watch_seconds = watch_seconds
        self.request_timeout = request_timeout
        self.backoff = backoff or RetryPolicy(attempts=1, base_delay=0.5, max_delay=30.0)
        self.rng = rng or random.Random()
        self._slices: dict[str, set[str]] = {}
        self.ignored: set[str] = set()
        """Names of the selected slices not made by the EndpointSlice controller (ignored)."""
        self.lists = 0
        self.events = 0

    def _apply(self) -> None:
        urls = set().union(*self._slices.values()) if self._slices else set()
        self.pools[self.selector.pool].replace_source(self.selector.source, urls)

    def _urls(self, raw: Mapping[str, Any]) -> set[str]:
        return slice_urls(raw, self.selector.port, self.selector.scheme)

    def _take(self, name: str, raw: Mapping[str, Any]) -> None:
        """Record one listed, added or modified slice: its URLs if the controller made it, else none."""
        if controller_managed(raw):
            self.ignored.discard(name)
            self._slices[name] = self._urls(raw)
            return
        self._slices.pop(name, None)
        if name not in self.ignored:
            self.ignored.add(name)
            labels = (raw.get("metadata") or {}).get("labels") or {}
            log.warning("EndpointSlice %s/%s for %s ignored: %s is %r, not %r", self.selector.namespace,
                        name, self.selector.source, MANAGED_BY_LABEL, labels.get(MANAGED_BY_LABEL),
                        CONTROLLER)

    async def sync(self) -> str | None:
        """List the selected slices and make them the pool's source; returns the resource version."""
        result = await self.api.list_namespaced_endpoint_slice(
            self.selector.namespace, label_selector=self.selector.label_selector,
            _request_timeout=self.request_timeout)
        sanitize = self.api_client.sanitize_for_serialization
        self._slices = {}
        for item in result.items or []:
            raw = sanitize(item)
            self._take(raw["metadata"]["name"], raw)
        self.lists += 1
        self._apply()
        rv = result.metadata.resource_version if result.metadata is not None else None
        return rv if isinstance(rv, str) else None

    async def watch_once(self, resource_version: str | None) -> str | None:
        """Follow one watch until the server ends it; returns the last resource version seen."""
        w = watch.Watch()
        kwargs: dict[str, Any] = {
            "label_selector": self.selector.label_selector,
            "timeout_seconds": self.watch_seconds,
            "allow_watch_bookmarks": True,
            "_request_timeout": self.watch_seconds + self.request_timeout,
        }
        if resource_version is not None:
            kwargs["resource_version"] = resource_version
        async with w.stream(self.api.list_namespaced_endpoint_slice, self.selector.namespace,
                            **kwargs) as stream:
            async for event in stream:
                kind = event["type"]
                raw = event["raw_object"]
                name = raw.get("metadata", {}).get("name")
                if kind in ("ADDED", "MODIFIED") and name:
                    self._take(name, raw)
                elif kind == "DELETED" and name:
                    self._slices.pop(name, None)
                    self.ignored.discard(name)
                else:
                    continue  # BOOKMARK
                self.events += 1
                self._apply()
        rv = w.resource_version
        return rv if isinstance(rv, str) else resource_version

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                rv = await self.sync()
                failures = 0
                while True:
                    rv = await self.watch_once(rv)
            except asyncio.CancelledError:
                raise
            except ApiException as e:
                if e.status != 410:
                    failures += 1
                log.warning("EndpointSlice watch for %s ended (%s); listing again",
                            self.selector.source, e.status)
            except Exception as e:
                failures += 1
                log.warning("EndpointSlice watch for %s failed: %s", self.selector.source, type(e).__name__)
            if failures:
                await asyncio.sleep(self.backoff.delay(min(failures, 10), self.rng))
