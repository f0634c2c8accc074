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


@dataclass(slots=True)
class PickNote:
    """Why ``kv_events`` chose a worker, filled in by the policy: the worker, the prompt tokens
    it was predicted to hold cached (None: nothing known of it), and the rule that decided."""

    worker: str = ""
    cached: int | None = None
    prompt_tokens: int = 0
    rule: str = ""
    """``kv``: the cache-and-load score; ``hash``: the ``prefix`` fallback."""
    shared: int = 0
    """Prompt tokens at least two workers hold cached (not counted as a reason to pick one)."""

    def describe(self) -> str:
        """E.g. ``kv p1:384/448`` (worker ``p1`` of its URL's host:port, 384 of 448 tokens), and
        ``kv p1:384/448 shared 256`` when 256 of them are held by several workers."""
        where = self.worker.rpartition("//")[2]
        cached = "?" if self.cached is None else str(self.cached)
        tail = f" shared {self.shared}" if self.shared else ""
        return f"{self.rule} {where}:{cached}/{self.prompt_tokens}{tail}"


@dataclass(frozen=True, slots=True)
class PickContext:
    token_ids: Sequence[int] = ()
    session_id: str | None = None
    tokens: int = 0
    """Tokens the request may still generate (its ``max_tokens``), for ``least_tokens``."""
    note: PickNote | None = None
    """Where ``kv_events`` explains its choice (None: not asked)."""


class KvKnowledge(Protocol):
    """What the workers' KV-cache events say (``proxy.fleet.kv_events``)."""

    def cached_tokens(self, candidates: Sequence[Worker], token_ids: Sequence[int]) -> dict[str, int]:
        """Prompt tokens (whole leading blocks) each candidate holds cached, by URL; a worker
        nothing is known of (no events, stale, disconnected) is left out."""
        ...

    def picked(self, worker: Worker, cached: int | None, token_ids: Sequence[int]) -> None:
        """``worker`` was given the prompt (it should announce the blocks it did not hold)."""
        ...


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

    def bound(self, candidates: Sequence[Worker], load: LoadFn) -> float:
        """The most load a chosen worker may carry: the imbalance guard's cap."""
        return min(load(w) for w in candidates) * self.imbalance_ratio + self.imbalance_slack

    def order(self, candidates: Sequence[Worker], ctx: PickContext) -> list[Worker] | None:
        """The candidates in the prompt's rendezvous order (None: no full block to key on)."""
        key = self.prefix_key(ctx.token_ids, self.key_block_size(candidates))
        return None if key is None else rendezvous_order(key, candidates)

    def choose(self, candidates: Sequence[Worker], ctx: PickContext, load: LoadFn) -> Worker:
        ordered = self.order(candidates, ctx)
        if ordered is None:
            return self._fallback.choose(candidates, ctx, load)
        bound = self.bound(candidates, load)
        for worker in ordered:
            if load(worker) <= bound:
                return worker
        return ordered[0]  # unreachable: the least loaded is always within the bound


class KvAware:
    """``kv_events``: each prompt goes to the worker that holds most of it cached *beyond what is
    widely cached*, weighed against load by one rule. ``shared`` is the most cached tokens that
    at least two candidates hold (a common system prompt); among the workers within the ``prefix``
    policy's imbalance cap, the highest

        score = max(cached_tokens - shared, 0) - alpha * prompt_tokens * load

    (a request in flight on a worker counts as ``alpha`` of this prompt's work; ``load`` is the
    pool's: requests in flight, plus the worker's scraped queue with ``--use-scraped-load``), ties
    in the rendezvous order of the prompt's first blocks after ``shared`` (the same for every turn
    of a conversation). A prefix several workers hold is no reason to concentrate: new
    conversations spread as with ``prefix`` keyed past it, later turns follow their own blocks.
    When no candidate is known to hold any of the prompt (no events, all stale, nothing cached)
    the choice is ``prefix``'s, exactly."""

    name = "kv_events"

    def __init__(self, knowledge: KvKnowledge | None, fallback: PrefixAware, alpha: float = 0.5) -> None:
        if alpha < 0:
            raise ValueError("alpha must be >= 0")
        self.knowledge = knowledge
        self.fallback = fallback
        self.alpha = alpha

    def choose(self, candidates: Sequence[Worker], ctx: PickContext, load: LoadFn) -> Worker:
        known = {} if self.knowledge is None else self.knowledge.cached_tokens(candidates, ctx.token_ids)
        shared = 0
        if max(known.values(), default=0) <= 0:
            worker, rule = self.fallback.choose(candidates, ctx, load), "hash"
        else:
            shared = sorted(known.values())[-2] if len(known) > 1 else 0
            bound = self.fallback.bound(candidates, load)
            n = len(ctx.token_ids)
            worker = max((w for w in self.order(candidates, ctx.token_ids, shared) if load(w) <= bound),
                         key=lambda w: max(known.get(w.url, 0) - shared, 0) - self.alpha * n * load(w))
            rule = "kv"
        cached = known.get(worker.url)
        if self.knowledge is not None:
            self.knowledge.picked(worker, cached, ctx.token_ids)
        if ctx.note is not None:
            ctx.note.worker, ctx.note.cached, ctx.note.rule = worker.url, cached, rule
            ctx.note.prompt_tokens, ctx.note.shared = len(ctx.token_ids), shared
        return worker

    def order(self, candidates: Sequence[Worker], token_ids: Sequence[int], shared: int) -> list[Worker]:
        """The candidates in the rendezvous order of the prompt's first full blocks after its first
        ``shared`` tokens (``prefix``'s order for the prompt when no full block follows them)."""
        key = self.fallback.prefix_key(token_ids[shared:], self.fallback.key_block_size(candidates))
        if key is None:
            return self.fallback.order(candidates, PickContext(token_ids)) or list(candidates)
        return rendezvous_order(str(shared).encode() + b":" + key if shared else key, candidates)


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


POLICY_NAMES = ("round_robin", "least_loaded", "power_of_two", "prefix", "session", "least_tokens",
                "kv_events")


def make_policy(name: str, *, block_size: int | Callable[[], int] | None = 16, prefix_blocks: int = 4,
                imbalance_ratio: float = 1.5, imbalance_slack: float = 4.0,
                rng: random.Random | None = None, kv: KvKnowledge | None = None,
                kv_alpha: float = 0.5) -> Policy:
    prefix = PrefixAware(block_size=block_size, prefix_blocks=prefix_blocks,
                         imbalance_ratio=imbalance_ratio, imbalance_slack=imbalance_slack)
    makers: dict[str, Callable[[], Policy]] = {
        "round_robin": RoundRobin,
        "least_loaded": LeastLoaded,
        "power_of_two": lambda: PowerOfTwo(rng),
        "prefix": lambda: prefix,
        "session": SessionAffinity,
        "least_tokens": LeastOutstandingTokens,
        "kv_events": lambda: KvAware(kv, prefix, alpha=kv_alpha),
    }
    if name not in makers:
        raise ValueError(f"unknown routing policy {name!r} (one of: {', '.join(POLICY_NAMES)})")
    return makers[name]()
