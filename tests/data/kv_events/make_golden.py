"""Golden KV-event frames from vLLM 0.32's own classes (run once with the vLLM venv's Python):

    .venv-vllm/bin/python tests/data/kv_events/make_golden.py > tests/data/kv_events/golden.json

A real ``ZmqEventPublisher`` on the loopback publishes two batches; a SUB socket records what it
sends, and a DEALER asks the replay socket for every batch from seq 1 on. Frames are stored in hex,
with the decoded batches as plain data for the tests to compare with.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import (  # type: ignore[import-not-found]
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def batches() -> list[KVEventBatch]:
    sha = bytes(range(32))
    return [
        KVEventBatch(
            ts=1700000000.25,
            events=[
                BlockStored(
                    block_hashes=[sha, bytes(reversed(range(32)))],
                    parent_block_hash=None,
                    token_ids=list(range(100, 132)),
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                ),
                BlockRemoved(block_hashes=[sha], medium="GPU", group_idx=0),
            ],
        ),
        KVEventBatch(
            ts=1700000001.5,
            events=[
                BlockStored(
                    block_hashes=[2**64 - 1],
                    parent_block_hash=12345,
                    token_ids=[7] * 4,
                    block_size=4,
                    lora_id=3,
                    medium="CPU",
                    lora_name="adapter",
                    extra_keys=[("salt",)],
                    session_id="s-1",
                ),
                AllBlocksCleared(),
            ],
        ),
    ]


def main() -> int:
    pub_port, replay_port = free_port(), free_port()
    publisher = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://[::ffff:127.0.0.1]:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic="kv",
    )
    ctx: Any = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    sub.subscribe(b"kv")
    time.sleep(1.0)  # PUB drops what is sent before the subscription arrives
    want = batches()
    for b in want:
        publisher.publish(b)
    published = []
    for _ in range(len(want)):
        if not sub.poll(10_000):
            raise SystemExit("no batch published")
        published.append(sub.recv_multipart())
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (1).to_bytes(8, "big")])
    replayed = []
    for _ in range(10):
        if not dealer.poll(10_000):
            raise SystemExit("no replay answer")
        frames = dealer.recv_multipart()
        replayed.append(frames)
        if frames[2] == (-1).to_bytes(8, "big", signed=True):
            break
    publisher.shutdown()
    out = {
        "vllm": __import__("vllm").__version__,
        "topic": "kv",
        "published": [[f.hex() for f in m] for m in published],
        "replay_request": [b"".hex(), (1).to_bytes(8, "big").hex()],
        "replayed_from_1": [[f.hex() for f in m] for m in replayed],
        "batches": [msgspec.to_builtins(b, enc_hook=None) for b in want],
    }
    json.dump(out, sys.stdout, indent=1, default=lambda b: {"hex": b.hex()})
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
