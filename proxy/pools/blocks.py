"""Each worker's KV block size, learned from the worker itself.

vLLM exposes its cache configuration on ``/metrics`` as an info gauge::

    vllm:cache_config_info{block_size="16",engine="0",...} 1.0

(pd-sim exposes the same series). The block size drives the short-prompt bypass (a prompt shorter
than one block of the prefill worker that would take it skips the prefill hop), the prefix policy's
key (the prompt's first blocks), the pair preflight's prompt (one block and a token) and the
``pd_proxy_suspect_no_transfer_total`` counter (prompts of at least one block of the pair).

GPU vLLM's block is 16 tokens, the CPU build's 128; one setting for every worker would be wrong for
one of them, so :class:`BlockSizeLearner` reads each worker's ``/metrics`` once (again after the
worker failed its probes: it may come back with another configuration). ``--kv-block-size`` is an
override for every worker (then nothing is read). Until a worker's size is known, it counts as
:data:`FALLBACK_BLOCK_SIZE`, the smallest common one: a short prompt then goes through the prefill
hop (a correct answer, a little work wasted) instead of silently skipping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence

import aiohttp

from proxy.pools.worker import Worker

log = logging.getLogger(__name__)

CACHE_CONFIG_INFO = "vllm:cache_config_info"
FALLBACK_BLOCK_SIZE = 16
"""A worker's block size until it is known: vLLM's default on GPUs, the smallest in common use."""

FetchFn = Callable[[Worker], Awaitable[str]]
_BLOCK_SIZE_LABEL = re.compile(r'[{,]block_size="(\d+)"')


def parse_block_size(text: str) -> int | None:
    """The ``block_size`` label of ``vllm:cache_config_info`` in a ``/metrics`` page (the largest
    when several engines disagree), or None when the page has none. Only that series' lines are
    read: a vLLM page is ~750 lines (65 kB), and prometheus_client's parser would hold the event
    loop for ~20 ms per worker on it. In the exposition format a quote inside a label value is
    escaped (``\\"``), so ``,block_size="`` or ``{block_size="`` can only start that label."""
    sizes: list[int] = []
    key, at = "\n" + CACHE_CONFIG_INFO + "{", 0
    text = "\n" + text
    while (at := text.find(key, at)) >= 0:
        end = text.find("\n", at + 1)
        line = text[at:end] if end >= 0 else text[at:]
        sizes += [int(v) for v in _BLOCK_SIZE_LABEL.findall(line) if int(v) > 0]
        at += 1
    return max(sizes) if sizes else None


class BlockSizes:
    """The block size the proxy uses for each worker: ``override`` (``--kv-block-size``) when set,
    else what the worker said (``Worker.block_size``), else :data:`FALLBACK_BLOCK_SIZE`."""

    def __init__(self, override: int | None = None, fallback: int = FALLBACK_BLOCK_SIZE) -> None:
        if override is not None and override < 1:
            raise ValueError("the KV block size must be at least 1")
        self.override = override
        self.fallback = fallback

    @property
    def learning(self) -> bool:
        """Whether the workers' sizes are read from them (no override)."""
        return self.override is None

    def of(self, worker: Worker | None) -> int:
        if self.override is not None:
            return self.override
        if worker is None or worker.block_size is None:
            return self.fallback
        return worker.block_size

    def pair(self, prefill: Worker | None, decode: Worker | None) -> int:
        """A pair's block: the larger of its two (a prompt shorter than it fills no block of one side)."""
        return max(self.of(prefill), self.of(decode))

    def smallest(self, workers: Iterable[Worker]) -> int:
        """The smallest block among ``workers`` (the fallback for none)."""
        return min((self.of(w) for w in workers), default=self.of(None))


class BlockSizeLearner:
    """Reads the block size of every worker whose size is not known, at once when woken (a worker
    joined) and every ``interval`` seconds. A worker whose ``/metrics`` has no
    ``vllm:cache_config_info`` (another server) is logged once and keeps the fallback until it is
    forgotten (it failed its probes, or left and came back)."""

    def __init__(self, pools: Sequence[Iterable[Worker]], fetch: FetchFn) -> None:
        self.pools = list(pools)
        self.fetch = fetch
        self._silent: set[tuple[str, str]] = set()
        self._wake = asyncio.Event()

    def unknown(self) -> list[Worker]:
        return [w for pool in self.pools for w in pool
                if w.block_size is None and (w.pool, w.url) not in self._silent]

    def forget(self, worker: Worker) -> None:
        """Read the worker's size again (it may have restarted with another configuration)."""
        worker.block_size = None
        self._silent.discard((worker.pool, worker.url))
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    async def _one(self, worker: Worker) -> None:
        try:
            text = await self.fetch(worker)
            size = parse_block_size(text)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return  # unreachable for now: tried again at the next round
        if size is None:
            self._silent.add((worker.pool, worker.url))
            log.warning("%s worker %s: no %s on its /metrics; its KV block size counts as %d "
                        "(set --kv-block-size to override)", worker.pool, worker.url, CACHE_CONFIG_INFO,
                        FALLBACK_BLOCK_SIZE)
            return
        if worker.block_size != size:
            log.info("%s worker %s: KV block size %d (from its /metrics)", worker.pool, worker.url, size)
        worker.block_size = size

    async def learn_once(self) -> None:
        await asyncio.gather(*(self._one(w) for w in self.unknown()))

    async def run(self, interval: float) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        while True:
            self._wake.clear()
            try:
                await self.learn_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("learning the workers' KV block sizes failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()
