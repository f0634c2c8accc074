"""vLLM 0.32's KV-cache events on the wire (``--kv-events-config``), for publishers (pd-sim) and
subscribers (pd-proxy); the sockets are the caller's.

A PUB message is ``[topic, seq (8 bytes, big-endian), payload (msgpack KVEventBatch)]``, ``seq``
counting batches from 0. A replay: a DEALER sends ``[b"", start_seq]`` to the ROUTER and gets
``[b"", topic, seq, payload]`` per buffered batch from ``start_seq``, then ``[b"", b"", END_SEQ, b""]``."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Final, Literal

import msgspec

ExternalBlockHash = bytes | int

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"
SEQ_BYTES: Final = 8
END_SEQ: Final = (-1).to_bytes(SEQ_BYTES, "big", signed=True)


class KvEventsError(ValueError):
    """A frame or payload that is not a vLLM 0.32 KV-event batch, or an unusable config."""


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: a map tagged with the class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache. ``block_hashes[0]``'s parent is ``parent_block_hash``
    (None: the prompt's first block); ``token_ids`` holds ``block_size`` tokens per block."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted to make room, or replaced)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch in ``payload``; unknown fields are ignored (newer publishers), unknown event types
    and wrong shapes raise :class:`KvEventsError`."""
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventsError(f"not a KV event batch: {exc}") from None


def encode_seq(seq: int) -> bytes:
    if not 0 <= seq < 1 << 63:
        raise KvEventsError(f"sequence number out of range: {seq}")
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    """The sequence number in an 8-byte frame; -1 is the replay's end marker."""
    if len(frame) != SEQ_BYTES:
        raise KvEventsError(f"a sequence frame has {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def pub_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The PUB message of one batch (also what a replay sends after its empty delimiter)."""
    return [topic.encode(), encode_seq(seq), payload]


def parse_pub_frames(frames: list[bytes]) -> tuple[str, int, KVEventBatch]:
    """(topic, seq, batch) of a PUB message or of a replayed one without its delimiter."""
    if len(frames) != 3:
        raise KvEventsError(f"a KV event message has 3 frames, got {len(frames)}")
    topic, seq, payload = frames
    try:
        name = topic.decode()
    except UnicodeDecodeError:
        raise KvEventsError("the topic frame is not UTF-8") from None
    return name, decode_seq(seq), decode_batch(payload)


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to the replay socket to get every buffered batch from ``start_seq`` on."""
    return [b"", encode_seq(start_seq)]


def is_replay_end(frames: list[bytes]) -> bool:
    """True for the message that ends a replay (after the DEALER's empty delimiter is dropped)."""
    return len(frames) == 3 and frames[0] == b"" and frames[1] == END_SEQ


@dataclasses.dataclass(frozen=True)
class KvEventsConfig:
    """vLLM 0.32's ``--kv-events-config`` JSON (``vllm.config.KVEventsConfig``), same keys and defaults;
    ``replay_endpoint`` is always bound."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v is not None})

    @classmethod
    def from_json(cls, text: str) -> KvEventsConfig:
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise KvEventsError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise KvEventsError("--kv-events-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise KvEventsError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}")
        types: dict[str, tuple[type, ...]] = {
            "enable_kv_cache_events": (bool,),
            "publisher": (str, type(None)),
            "endpoint": (str,),
            "replay_endpoint": (str, type(None)),
            "buffer_steps": (int,),
            "hwm": (int,),
            "max_queue_size": (int,),
            "topic": (str,),
        }
        for key, value in raw.items():
            ok = isinstance(value, types[key]) and not (isinstance(value, bool) and bool not in types[key])
            if not ok:
                raise KvEventsError(f"--kv-events-config: {key} has the wrong type ({value!r})")
        if raw.get("publisher") not in (None, "null", "zmq"):
            raise KvEventsError(f"--kv-events-config: unknown publisher {raw['publisher']!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            if key in raw and raw[key] < 1:
                raise KvEventsError(f"--kv-events-config: {key} must be at least 1")
        return cls(**raw)


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB endpoint: bind wildcard, IPv6-form and ipc/inproc endpoints, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def loopback_bind_endpoint(port: int) -> str:
    """A PUB endpoint vLLM binds (it holds ``::``) on the IPv4 loopback only."""
    return f"tcp://[::ffff:127.0.0.1]:{port}"
