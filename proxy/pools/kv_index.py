"""What one prefill worker holds in its prefix cache, from its KV-cache events. vLLM's block hash
depends on the worker's hash seed, so each block is keyed by its *chain key* (parent's chain key,
tokens, extra keys, LoRA), the same on every worker; vLLM's hash -> chain key is kept for removals.
Any contiguous run of batches applied to an empty index gives a subset of what the worker holds."""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kv_transfer.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
)

ROOT: Final = b""
"""The chain key of a prompt's first block's parent."""


@dataclass(frozen=True, slots=True)
class KvSource:
    """Where one worker publishes: its PUB endpoint, its replay endpoint, its topic."""

    endpoint: str
    replay: str | None = None
    topic: str = ""

    @classmethod
    def parse(cls, spec: str) -> KvSource:
        """``ENDPOINT[,REPLAY]`` (``tcp://host:port`` or ``ipc://path``); ``ValueError`` otherwise."""
        parts = [p.strip() for p in spec.split(",")]
        if not 1 <= len(parts) <= 2 or not all(parts):
            raise ValueError(f"--kv-events takes ENDPOINT[,REPLAY_ENDPOINT], got {spec!r}")
        for p in parts:
            if not p.startswith(("tcp://", "ipc://")) or any(c.isspace() for c in p):
                raise ValueError(f"--kv-events: {p!r} is not a tcp:// or ipc:// endpoint")
        return cls(parts[0], parts[1] if len(parts) == 2 else None)


def kv_sources(specs: Sequence[str], prefill_urls: Sequence[str]) -> dict[str, KvSource]:
    """``--kv-events`` paired with ``--prefill``, in order; ``ValueError`` when the counts differ."""
    if specs and len(specs) != len(prefill_urls):
        raise ValueError(f"--kv-events gives {len(specs)} endpoint(s) for {len(prefill_urls)} --prefill "
                         "worker(s): give one per prefill worker, in the same order")
    return {url: KvSource.parse(spec) for url, spec in zip(prefill_urls, specs, strict=False)}


def chain_key(parent: bytes, tokens: Sequence[int], extra: Any = None, lora: int | None = None) -> bytes:
    """The chain key of a block holding ``tokens`` after the block keyed ``parent``."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if extra is not None or lora is not None:
        h.update(repr((extra, lora)).encode())
    return h.digest()


def prompt_keys(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """The chain keys of the prompt's leading full blocks (at most ``limit``), no salt, no LoRA."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    blocks = len(token_ids) // block_size
    if limit is not None:
        blocks = min(blocks, limit)
    keys: list[bytes] = []
    parent = ROOT
    for i in range(blocks):
        parent = chain_key(parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


def _counts(medium: str | None, group_idx: int | None) -> bool:
    """Blocks of the GPU cache of the first (or only) KV-cache group are indexed."""
    return (medium is None or medium == MEDIUM_GPU) and not group_idx


class BlockIndex:
    """One worker's cached blocks by chain key, at most ``max_blocks`` (least recently stored or
    looked up dropped first: the index then knows less than the worker, never more)."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self.block_size: int | None = None
        """The block size of the worker's events (None until one block was stored)."""
        self._keys: OrderedDict[bytes, ExternalBlockHash] = OrderedDict()
        self._by_hash: dict[ExternalBlockHash, bytes] = {}
        self.evicted = 0
        """Blocks dropped to keep the bound."""

    def __len__(self) -> int:
        return len(self._keys)

    def clear(self) -> None:
        self._keys.clear()
        self._by_hash.clear()

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                if _counts(event.medium, event.group_idx):
                    for h in event.block_hashes:
                        self._drop_hash(h)
            elif isinstance(event, AllBlocksCleared):
                self.clear()

    def _stored(self, e: BlockStored) -> None:
        if not _counts(e.medium, e.group_idx) or e.block_size < 1 \
                or len(e.token_ids) != e.block_size * len(e.block_hashes):
            return
        if e.parent_block_hash is None:
            parent: bytes | None = ROOT
        else:
            parent = self._by_hash.get(e.parent_block_hash)
        if parent is None:
            return  # its parent is unknown: no prompt lookup can reach it
        self.block_size = e.block_size
        for i, h in enumerate(e.block_hashes):
            extra = e.extra_keys[i] if e.extra_keys is not None and i < len(e.extra_keys) else None
            tokens = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
            parent = chain_key(parent, tokens, extra, e.lora_id)
            self._drop_hash(h)
            old = self._keys.pop(parent, None)
            if old is not None:
                self._by_hash.pop(old, None)
            self._keys[parent] = h
            self._by_hash[h] = parent
        while len(self._keys) > self.max_blocks:
            _, h = self._keys.popitem(last=False)
            self._by_hash.pop(h, None)
            self.evicted += 1

    def _drop_hash(self, h: ExternalBlockHash) -> None:
        key = self._by_hash.pop(h, None)
        if key is not None:
            self._keys.pop(key, None)

    def cached_blocks(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a prompt's leading blocks, in order) are held, from the first on;
        those found count as used now (kept longest under the bound)."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            self._keys.move_to_end(key)
            n += 1
        return n

    def has_all(self, keys: Sequence[bytes]) -> bool:
        return all(key in self._keys for key in keys)


def match_prefix(indexes: dict[str, BlockIndex], token_ids: Sequence[int], block_size: int) -> dict[str, int]:
    """Leading full blocks of the prompt each index holds, for indexes of one ``block_size``: each
    block's key is computed once, and only while some index still holds every block before it."""
    counts = dict.fromkeys(indexes, 0)
    alive = dict(indexes)
    parent = ROOT
    for i in range(len(token_ids) // block_size):
        if not alive:
            break
        parent = chain_key(parent, token_ids[i * block_size:(i + 1) * block_size])
        for name, index in list(alive.items()):
            if index.cached_blocks((parent,)):
                counts[name] += 1
            else:
                del alive[name]
    return counts
