"""The prefill workers' KV-cache events (``--kv-events``), followed for the ``kv_events`` policy:
one task per worker subscribes to its publisher and keeps a :class:`BlockIndex`, always a subset of
the worker's cache. Batches apply in ``seq`` order; a gap the replay cannot fill, a lower ``seq``, a
lost connection or a failed probe drops the index. A worker sent a prefill of new blocks that
announces nothing within ``stale_after`` counts as unknown and is routed by the fallback."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kv_transfer.kv_events import KVEventBatch, KvEventsError, is_replay_end, parse_pub_frames, replay_request
from proxy.fleet.kv_metrics import KvEventsMetrics
from proxy.pools.blocks import FALLBACK_BLOCK_SIZE
from proxy.pools.kv_index import BlockIndex, KvSource, kv_sources, match_prefix, prompt_keys
from proxy.pools.worker import Worker

log = logging.getLogger(__name__)

__all__ = ["KvEventsHub", "KvSource", "kv_sources"]

REPLAY_TIMEOUT: Final = 2.0
"""Seconds a replay may go without a message before it counts as failed."""
MAX_REPLAY: Final = 100_000
"""The most batches one replay reads."""
RETRY_DELAY: Final = 1.0


@dataclass(eq=False)
class Feed:
    """One worker's event stream as followed: its index, the next ``seq``, its freshness."""

    source: KvSource
    index: BlockIndex
    expected: int = 0
    connected: bool = False
    pending_since: float | None = None
    """When a prefill that should have stored new blocks was sent, with no batch since."""
    replayed: dict[int, bytes] = field(default_factory=dict)
    """Digests of the payloads the last replay gave past ``expected``'s then value: the same
    batches arriving live are duplicates, not a restart."""

    def reset(self) -> None:
        self.index.clear()
        self.expected = 0
        self.pending_since = None
        self.replayed.clear()


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class KvEventsHub:
    """Every prefill worker's feed, the ``kv_events`` policy's :class:`~proxy.pools.policies.KvKnowledge`."""

    def __init__(self, sources: Mapping[str, KvSource], *, max_blocks: int = 100_000,
                 stale_after: float = 30.0, metrics: KvEventsMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if stale_after <= 0:
            raise ValueError("stale_after must be positive")
        self.feeds = {url: Feed(src, BlockIndex(max_blocks)) for url, src in sources.items()}
        self.stale_after = stale_after
        self.metrics = metrics
        self.clock = clock
        self._ctx: zmq.asyncio.Context | None = None
        if metrics is not None:
            metrics.watch(self)

    # -------------------------------------------------------------- the policy's view

    def stale(self, feed: Feed) -> bool:
        return feed.pending_since is not None and self.clock() - feed.pending_since > self.stale_after

    def usable(self, url: str) -> Feed | None:
        feed = self.feeds.get(url)
        if feed is None or not feed.connected or self.stale(feed):
            return None
        return feed

    def cached_tokens(self, candidates: Sequence[Worker], token_ids: Sequence[int]) -> dict[str, int]:
        by_size: dict[int, dict[str, BlockIndex]] = {}
        for w in candidates:
            feed = self.usable(w.url)
            if feed is not None:
                size = feed.index.block_size or w.block_size or FALLBACK_BLOCK_SIZE
                by_size.setdefault(size, {})[w.url] = feed.index
        out: dict[str, int] = {}
        for size, indexes in by_size.items():
            # vLLM computes a prompt's last token again: a fully cached prompt hits one block less.
            hit = max(0, (len(token_ids) - 1) // size)
            out.update({url: min(n, hit) * size for url, n in match_prefix(indexes, token_ids, size).items()})
        return out

    def picked(self, worker: Worker, cached: int | None, token_ids: Sequence[int]) -> None:
        """Given a prompt with full blocks it does not hold, the worker must announce them."""
        feed = self.feeds.get(worker.url)
        if feed is None or not feed.connected or feed.pending_since is not None:
            return
        size = feed.index.block_size or worker.block_size or FALLBACK_BLOCK_SIZE
        full = len(token_ids) // size
        if (cached or 0) // size < full - 1 or not feed.index.has_all(prompt_keys(token_ids, size)):
            feed.pending_since = self.clock()

    def forget(self, worker: Worker) -> None:
        """The worker failed its probes: it may come back restarted, with an empty cache."""
        feed = self.feeds.get(worker.url)
        if feed is not None:
            self._reset(worker.url, feed, "unhealthy")

    # -------------------------------------------------------------- applying batches

    def _reset(self, url: str, feed: Feed, why: str) -> None:
        if len(feed.index) or feed.expected:
            log.info("prefill worker %s: KV event index dropped (%s)", url, why)
        feed.reset()
        if self.metrics is not None:
            self.metrics.resets.labels(reason=why).inc()

    def _apply(self, feed: Feed, seq: int, batch: KVEventBatch) -> None:
        feed.index.apply(batch.events)
        feed.expected = seq + 1
        feed.pending_since = None
        if self.metrics is not None:
            self.metrics.batches.inc()
            self.metrics.events.inc(len(batch.events))

    async def offer(self, url: str, seq: int, payload: bytes, batch: KVEventBatch) -> None:
        """A batch from the SUB socket."""
        feed = self.feeds[url]
        if seq < feed.expected:
            if feed.replayed.get(seq) == _digest(payload):
                return  # seen in the last replay
            self._reset(url, feed, "restart")
        feed.replayed.clear()
        if seq > feed.expected:
            if self.metrics is not None:
                self.metrics.gaps.inc()
            if not await self.fill(url, feed, feed.expected, seq):
                self._reset(url, feed, "gap")
        self._apply(feed, seq, batch)

    async def fill(self, url: str, feed: Feed, start: int, stop: int | None) -> bool:
        """Apply the replayed batches ``start..stop-1`` (to the end of the worker's buffer when
        ``stop`` is None). False, nothing applied, when the replay cannot give all of them."""
        got = await self.replay(feed.source, start) if feed.source.replay is not None else None
        if got is None:
            return False
        wanted = [(s, p, b) for s, p, b in got if stop is None or s < stop]
        whole = [s for s, _, _ in wanted] == list(range(start, start + len(wanted))) and \
            (stop is None or start + len(wanted) == stop)
        if self.metrics is not None:
            self.metrics.replays.labels(result="ok" if whole else "incomplete").inc()
        if not whole:
            return False
        for s, p, b in wanted:
            self._apply(feed, s, b)
            feed.replayed[s] = _digest(p)
        return True

    async def sync(self, url: str) -> None:
        """A new connection: what the worker held is unknown; learn what its replay buffer still gives."""
        feed = self.feeds[url]
        self._reset(url, feed, "connect")
        if feed.source.replay is None:
            return
        got = await self.replay(feed.source, 0)
        if not got:
            return
        first = got[0][0]
        feed.expected = first
        await self.fill(url, feed, first, None)

    # -------------------------------------------------------------- sockets

    def context(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    async def replay(self, source: KvSource, start: int) -> list[tuple[int, bytes, KVEventBatch]] | None:
        """Every buffered batch from ``start`` on; None when the replay socket fails to answer in time."""
        assert source.replay is not None
        dealer = self.context().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes, KVEventBatch]] = []
        try:
            dealer.connect(source.replay)
            await dealer.send_multipart(replay_request(start))
            for _ in range(MAX_REPLAY):
                if not await dealer.poll(int(REPLAY_TIMEOUT * 1000)):
                    return None
                frames: list[bytes] = await dealer.recv_multipart()
                if not frames or frames[0] != b"":
                    return None
                if is_replay_end(frames[1:]):
                    return out
                topic, seq, batch = parse_pub_frames(frames[1:])
                if topic == source.topic:
                    out.append((seq, frames[3], batch))
            return None
        except (KvEventsError, zmq.ZMQError) as e:
            log.warning("KV event replay from %s failed: %s", source.replay, e)
            return None
        finally:
            dealer.close(linger=0)

    async def follow(self, url: str) -> None:
        """Follow one worker until cancelled: reconnect after an error, after a pause."""
        while True:
            try:
                await self._session(url)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("prefill worker %s: following its KV events failed; reconnecting", url)
            self.feeds[url].connected = False
            self._reset(url, self.feeds[url], "error")
            await asyncio.sleep(RETRY_DELAY)

    async def _session(self, url: str) -> None:
        feed = self.feeds[url]
        sub = self.context().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.subscribe(feed.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            sub.connect(feed.source.endpoint)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await self._on_monitor(url, parse_monitor_message(await monitor.recv_multipart()))
                if sub in ready:
                    await self._on_message(url, await sub.recv_multipart())
        finally:
            feed.connected = False
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_monitor(self, url: str, event: Mapping[str, Any]) -> None:
        feed = self.feeds[url]
        if event["event"] == zmq.EVENT_CONNECTED:
            feed.connected = True
            await self.sync(url)
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            feed.connected = False
            self._reset(url, feed, "disconnect")

    async def _on_message(self, url: str, frames: list[bytes]) -> None:
        try:
            topic, seq, batch = parse_pub_frames(frames)
        except KvEventsError as e:
            log.warning("prefill worker %s: a KV event message was not understood: %s", url, e)
            return
        if topic == self.feeds[url].source.topic:
            await self.offer(url, seq, frames[2], batch)

    async def close(self) -> None:
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
