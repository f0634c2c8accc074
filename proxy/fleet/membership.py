"""Which workers are in which pool: a worker is a member while any source (``static``, ``file``,
``admin``, ``k8s:...``) declares it. The ``--workers-file``, reloaded when it changes::

    [pools.prefill]
    policy = "prefix"                      # optional: a routing policy name
    workers = ["http://10.0.0.1:8100", "http://10.0.0.2:8100"]

    [pools.decode]
    workers = ["http://10.0.0.3:8200"]

A file that fails to parse or validate is logged and ignored: the previous membership stays."""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from proxy.fleet.health import repeat
from proxy.pools.policies import POLICY_NAMES, Policy
from proxy.pools.pool import Pool, normalize_url

log = logging.getLogger(__name__)

FILE_SOURCE = "file"
ADMIN_SOURCE = "admin"


class WorkerMetrics(Protocol):
    """What ``Pools.forget_workers_in`` needs of the app's metrics."""

    members: Callable[[str, str], bool] | None

    def forget_worker(self, pool: str, worker: str) -> None: ...


class Pools:
    """The proxy's pools by name (``prefill``, ``decode``)."""

    def __init__(self, pools: Iterable[Pool], policy_factory: Callable[[str], Policy] | None = None) -> None:
        self._pools = {p.name: p for p in pools}
        self.policy_factory = policy_factory

    def __getitem__(self, name: str) -> Pool:
        return self._pools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._pools

    def __iter__(self) -> Iterator[Pool]:
        return iter(self._pools.values())

    @property
    def names(self) -> list[str]:
        return list(self._pools)

    def apply(self, source: str, members: Mapping[str, Iterable[str]]) -> None:
        """Make ``source`` declare exactly ``members`` (pools it does not name: none)."""
        unknown = set(members) - set(self._pools)
        if unknown:
            raise ValueError(f"unknown pool(s): {', '.join(sorted(unknown))}")
        for name, pool in self._pools.items():
            pool.replace_source(source, members.get(name, ()))

    def is_member(self, pool: str, url: str) -> bool:
        """``url`` (normalized) is a member of ``pool`` now."""
        found = self._pools.get(pool)
        return found is not None and found.has(url)

    def forget_workers_in(self, metrics: WorkerMetrics) -> None:
        """Keep ``metrics`` to the members: series made only for them, removed when one leaves."""
        metrics.members = self.is_member
        for pool in self._pools.values():
            pool.on_leave.append(lambda p, w: metrics.forget_worker(p.name, w.url))

    def set_policy(self, pool: str, name: str) -> None:
        current = self._pools[pool].policy
        if current.name != name and self.policy_factory is not None:
            self._pools[pool].policy = self.policy_factory(name)

    def snapshot(self) -> dict[str, list[dict[str, object]]]:
        return {name: [w.as_dict() for w in pool] for name, pool in self._pools.items()}


class PoolFileConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workers: list[str] = Field(default_factory=list)
    policy: str | None = None

    @field_validator("workers")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        return [normalize_url(u) for u in v]

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str | None) -> str | None:
        if v is not None and v not in POLICY_NAMES:
            raise ValueError(f"unknown routing policy {v!r} (one of: {', '.join(POLICY_NAMES)})")
        return v


class FileConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pools: dict[str, PoolFileConfig] = Field(default_factory=dict)


def load_config(path: Path) -> FileConfig:
    """Parse and validate the file; ``ValueError`` with a readable reason otherwise."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    try:
        return FileConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"{path}: {e.errors(include_url=False, include_input=False)}") from None


class ConfigFileSource:
    """Reloads the file when its mtime, size or inode changes (``check`` is one poll)."""

    def __init__(self, path: Path, pools: Pools) -> None:
        self.path = path
        self.pools = pools
        self._stamp: tuple[int, int, int] | None = None
        self.loads = 0
        self.errors = 0
        self.last_error: str | None = None

    def _current_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def check(self) -> bool:
        """Apply the file if it changed since the last check; True if it was (re)applied."""
        stamp = self._current_stamp()
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            config = load_config(self.path)
            self.pools.apply(FILE_SOURCE, {name: pc.workers for name, pc in config.pools.items()})
        except (ValueError, OSError) as e:
            self.errors += 1
            self.last_error = str(e)
            log.error("worker config file not applied (keeping the previous membership): %s", e)
            return False
        for name, pc in config.pools.items():
            if pc.policy is not None:
                self.pools.set_policy(name, pc.policy)
        self.loads += 1
        self.last_error = None
        log.info("worker config file applied: %s", {n: len(pc.workers) for n, pc in config.pools.items()})
        return True

    async def run(self, interval: float) -> None:
        async def step() -> None:
            self.check()

        await repeat(interval, step)
