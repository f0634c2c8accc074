"""Routing policies: which of a pool's available workers takes a request (proxy/pools/README.md).

Rendezvous hashing uses blake2b, not the salted ``hash()``: the choice depends on the key and the
workers' URLs only, so every process and replica with the same membership picks the same worker."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from proxy.pools.blocks import FALLBACK_BLOCK_SIZE
from proxy.pools.worker import Worker

LoadFn = Callable[[Worker], float]


@dataclass(frozen=True, slots=True)
class PickContext:
    token_ids: Sequence[int] = ()
    session_id: str | None = None
    tokens: int = 0


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Worker], ctx: PickContext, load: LoadFn) -> Worker: ...


def rendezvous_order(key: bytes, candidates: Sequence[Worker]) -> list[Worker]:
    """Candidates by descending rendezvous weight for ``key`` (stable across processes)."""

    salt = hashlib.blake2b(key, digest_size=16).digest()

    def weight(w: Worker) -> int:
        return int.from_bytes(hashlib.blake2b(w.url.encode(), digest_size=8, key=salt).digest(), "big")

    return sorted(candidates, key=weight, reverse=True)


class _Turns:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def rotate(self, candidates: Sequence[Worker]) -> list[Worker]:
        start = next(self._counter) % len(candidates)
        return [*candidates[start:], *candidates[:start]]


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, candidates: Sequence[Worker], ctx: PickContext, load: LoadFn) -> Worker:
        return self._turns.rotate(candidates)[0]


class LeastLoaded:
    name = "least_loaded"

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, candidates: Sequence[Worker], ctx: PickContext, load: LoadFn) -> Worker:
        return min(self._turns.rotate(candidates), key=load)


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Worker], ctx: PickContext, load: LoadFn) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return b if load(b) < load(a) else a


class PrefixAware:
    name = "prefix"

    def __init__(self, *, block_size: int | Callable[[], int] | None = 16, prefix_blocks: int = 4,
                 imbalance_ratio: float = 1.5, imbalance_slack: float = 4.0) -> None:
        """``block_size``: the key's block; a callable is asked at each pick; None: the
        candidates' smallest."""
        if (isinstance(block_size, int) and block_size < 1) or prefix_blocks < 1:
            raise ValueError("block_size and prefix_blocks must be at least 1")
        if imbalance_ratio < 1.0 or imbalance_slack < 0:
            raise ValueError("imbalance_ratio must be >= 1 and imbalance_slack >= 0")
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.imbalance_ratio = imbalance_ratio
        self.imbalance_slack = imbalance_slack
        self._fallback = LeastLoaded()

    def prefix_key(self, token_ids: Sequence[int], block_size: int | None = None) -> bytes | None:
        """The first full blocks of the prompt (at most ``prefix_blocks``), or None if none is full."""
        size = block_size or (self.block_size if isinstance(self.block_size, int) else None) \
            or FALLBACK_BLOCK_SIZE
        blocks = min(self.prefix_blocks, len(token_ids) // size)
        if blocks == 0:
            return None
        head = token_ids[: blocks * size]
        return ",".join(map(str, head)).encode()

    def key_block_size(self, candidates: Sequence[Worker]) -> int:
        if isinstance(self.block_size, int):
            return self.block_size
        if self.block_size is not None:
            return self.block_size()
        return min((w.block_size for w in candidates if w.block_size), default=FALLBACK_BLOCK_SIZE)

    def choose(self, candidates: Sequence[Worker], ctx: PickContext, load: LoadFn) -> Worker:
        key = self.prefix_key(ctx.token_ids, self.key_block_size(candidates))
        if key is None:
            return self._fallback.choose(candidates, ctx, load)
        bound = min(load(w) for w in candidates) * self.imbalance_ratio + self.imbalance_slack
        ordered = rendezvous_order(key, candidates)
        for worker in ordered:
            if load(worker) <= bound:
                return worker
        return ordered[0]  # unreachable: the least loaded is always within the bound


class SessionAffinity:
    name = "session"

    def __init__(self) -> None:
        self._fallback = LeastLoaded()

    def choose(self, candidates: Sequence[Worker], ctx: PickContext, load: LoadFn) -> Worker:
        if not ctx.session_id:
            return self._fallback.choose(candidates, ctx, load)
        return rendezvous_order(ctx.session_id.encode(), candidates)[0]


class LeastOutstandingTokens:
    name = "least_tokens"

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, candidates: Sequence[Worker], ctx: PickContext, load: LoadFn) -> Worker:
        return min(self._turns.rotate(candidates), key=lambda w: (w.outstanding_tokens, load(w)))


POLICY_NAMES = ("round_robin", "least_loaded", "power_of_two", "prefix", "session", "least_tokens")


def make_policy(name: str, *, block_size: int | Callable[[], int] | None = 16, prefix_blocks: int = 4,
                imbalance_ratio: float = 1.5, imbalance_slack: float = 4.0,
                rng: random.Random | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "power_of_two":
        return PowerOfTwo(rng)
    if name == "prefix":
        return PrefixAware(block_size=block_size, prefix_blocks=prefix_blocks,
                           imbalance_ratio=imbalance_ratio, imbalance_slack=imbalance_slack)
    if name == "session":
        return SessionAffinity()
    if name == "least_tokens":
        return LeastOutstandingTokens()
    raise ValueError(f"unknown routing policy {name!r} (one of: {', '.join(POLICY_NAMES)})")
