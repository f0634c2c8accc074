"""pd-sim's KV-event publisher: vLLM 0.32's ``ZmqEventPublisher`` on the event loop.

Each batch goes out on the PUB socket as ``[topic, seq, payload]`` (``kv_transfer.kv_events``) and
stays in a buffer of ``buffer_steps`` batches that the ROUTER replay socket serves from: a request
``[b"", start_seq]`` is answered with every buffered batch from ``start_seq`` on, then the end
marker. The PUB endpoint is bound or connected by vLLM's rule; the replay endpoint is bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from kv_transfer.kv_events import (
    END_SEQ,
    SEQ_BYTES,
    KVEvent,
    KVEventBatch,
    KvEventsConfig,
    KvEventsError,
    binds,
    encode_batch,
    pub_frames,
)

log = logging.getLogger("pd_sim")


class SimKvEventPublisher:
    """Publishes batches from the event loop's thread; :meth:`start` runs the replay service."""

    def __init__(self, config: KvEventsConfig) -> None:
        self.config = config
        self._ctx = zmq.asyncio.Context()
        self._topic = config.topic
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self._pub: zmq.asyncio.Socket = self._ctx.socket(zmq.PUB)
        self._replay: zmq.asyncio.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(config.endpoint)
                self.endpoint = config.endpoint
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self.close()
            raise KvEventsError(f"--kv-events-config: cannot open {config.endpoint}: {exc}") from None

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: list[KVEvent]) -> None:
        """Send one batch now (PUB never blocks: past the high-water mark it drops, as vLLM's does)."""
        if not events:
            return
        seq = self._seq
        self._seq += 1
        payload = encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(pub_frames(self._topic, seq, payload), flags=zmq.NOBLOCK)

    def start(self) -> None:
        if self._replay is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(self._replay))

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        # Runs until close() cancels it; each request is answered from a snapshot of the buffer.
        while True:
            frames: list[Any] = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != SEQ_BYTES:
                log.info("pd-sim: ignored a malformed KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await sock.send_multipart([client, b"", *pub_frames(self._topic, seq, payload)])
            await sock.send_multipart([client, b"", b"", END_SEQ, b""])

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.close()

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
