"""The KV-event wire module against frames recorded from vLLM 0.32's own publisher
(tests/data/kv_events/golden.json, made by make_golden.py next to it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_transfer.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KvEventsConfig,
    KvEventsError,
    binds,
    decode_batch,
    decode_seq,
    encode_batch,
    is_replay_end,
    loopback_bind_endpoint,
    parse_pub_frames,
    pub_frames,
    replay_request,
)

GOLDEN = json.loads((Path(__file__).parent.parent / "data" / "kv_events" / "golden.json").read_text())


def frames(hexes: list[str]) -> list[bytes]:
    return [bytes.fromhex(h) for h in hexes]


def expected_batches() -> list[KVEventBatch]:
    """The batches make_golden.py built with vLLM's classes, rebuilt with ours."""
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
            data_parallel_rank=0,
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
            data_parallel_rank=0,
        ),
    ]


def test_vllm_published_frames_decode_to_the_batches_it_was_given() -> None:
    got = [parse_pub_frames(frames(m)) for m in GOLDEN["published"]]
    assert [(topic, seq) for topic, seq, _ in got] == [("kv", 0), ("kv", 1)]
    assert [b for _, _, b in got] == expected_batches()


def test_our_encoding_is_byte_identical_to_vllms() -> None:
    for (seq, batch), message in zip(enumerate(expected_batches()), GOLDEN["published"], strict=True):
        assert pub_frames("kv", seq, encode_batch(batch)) == frames(message)


def test_replay_request_and_answer_match_vllms_replay_socket() -> None:
    assert replay_request(1) == frames(GOLDEN["replay_request"])
    answer = [frames(m) for m in GOLDEN["replayed_from_1"]]
    # A DEALER sees the ROUTER's empty delimiter first, then (topic, seq, payload).
    assert all(m[0] == b"" for m in answer)
    assert [is_replay_end(m[1:]) for m in answer] == [False, True]
    topic, seq, batch = parse_pub_frames(answer[0][1:])
    assert (topic, seq, batch) == ("kv", 1, expected_batches()[1])
    assert decode_seq(answer[-1][2]) == -1


def test_events_are_tagged_maps_and_the_batch_an_array() -> None:
    raw: Any = msgspec.msgpack.decode(encode_batch(expected_batches()[0]))
    assert isinstance(raw, list) and raw[0] == 1700000000.25 and raw[2] == 0
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [bytes(range(32))], "medium": "GPU",
                         "group_idx": 0}
    # Required fields stay even when None; defaulted ones go while they hold their default.
    assert raw[1][0]["lora_id"] is None and "extra_keys" not in raw[1][0]


hashes = st.one_of(st.binary(min_size=1, max_size=32), st.integers(0, 2**64 - 1))
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, min_size=1, max_size=4),
    parent_block_hash=st.none() | hashes,
    token_ids=st.lists(st.integers(0, 2**31), max_size=64),
    block_size=st.integers(1, 64),
    lora_id=st.none() | st.integers(0, 100),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    lora_name=st.none() | st.text(max_size=8),
    group_idx=st.none() | st.integers(0, 4),
    session_id=st.none() | st.text(max_size=8),
)
removed = st.builds(BlockRemoved, block_hashes=st.lists(hashes, min_size=1, max_size=4),
                    medium=st.sampled_from([None, "GPU"]), group_idx=st.none() | st.integers(0, 4))
batches = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=6),
    data_parallel_rank=st.none() | st.integers(0, 8),
)


@given(batches, st.integers(0, 2**63 - 1), st.text(max_size=8))
def test_round_trip(batch: KVEventBatch, seq: int, topic: str) -> None:
    assert parse_pub_frames(pub_frames(topic, seq, encode_batch(batch))) == (topic, seq, batch)


@pytest.mark.parametrize(
    "message",
    [
        [b"kv", b"\x00" * 8],
        [b"kv", b"\x00" * 7, b"\x90"],
        [b"kv", b"\x00" * 8, b"not msgpack"],
        [b"kv", b"\x00" * 8, bytes.fromhex("92cb000000000000000091" "81a474797065a54f74686572")],
        [b"\xff", b"\x00" * 8, encode_batch(KVEventBatch(ts=0.0, events=[]))],
    ],
    ids=["two-frames", "short-seq", "garbage", "unknown-event-type", "topic-not-utf8"],
)
def test_malformed_messages_are_a_clear_error(message: list[bytes]) -> None:
    with pytest.raises(KvEventsError):
        parse_pub_frames(message)


def test_unknown_fields_of_newer_publishers_are_ignored() -> None:
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": None, "future": 1}]]
    )
    assert decode_batch(payload).events == [BlockRemoved(block_hashes=[1], medium=None)]


def test_config_json_takes_vllms_keys_and_defaults() -> None:
    cfg = KvEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
        ' "replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 5, "hwm": 10}'
    )
    assert cfg.publishes and cfg.buffer_steps == 5 and cfg.topic == "kv" and cfg.max_queue_size == 100_000
    assert KvEventsConfig.from_json('{"enable_kv_cache_events": true}').publishes
    assert not KvEventsConfig.from_json('{"enable_kv_cache_events": false}').publishes
    assert not KvEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    assert KvEventsConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    "text",
    ["[]", "{", '{"endpont": "tcp://*:1"}', '{"hwm": true}', '{"buffer_steps": 0}', '{"publisher": "kafka"}',
     '{"enable_kv_cache_events": 1}'],
)
def test_bad_config_json_is_a_clear_error(text: str) -> None:
    with pytest.raises(KvEventsError, match="kv-events-config"):
        KvEventsConfig.from_json(text)


def test_bind_rule_is_vllms() -> None:
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and binds(loopback_bind_endpoint(5557))
    assert not binds("tcp://127.0.0.1:5557")
