"""Datasets: deterministic, lengths as asked, token ids inside the safe vocabulary."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.datasets import DatasetConfig, DatasetError, build_dataset


def test_random_is_deterministic_and_in_range() -> None:
    cfg = DatasetConfig(num_requests=50, input_len=100, output_len=20, range_ratio=0.1, seed=3)
    a, b = build_dataset(cfg), build_dataset(cfg)
    assert a == b
    assert build_dataset(DatasetConfig(num_requests=50, seed=4)) != build_dataset(
        DatasetConfig(num_requests=50, seed=5)
    )
    assert len(a) == 50
    assert all(90 <= len(s.prompt) <= 110 and 18 <= s.output_len <= 22 for s in a)
    assert len({len(s.prompt) for s in a}) > 1
    assert all(3 <= t <= 514 for s in a for t in s.prompt)
    assert all(s.arrival_s is None for s in a)


def test_random_exact_lengths_without_range() -> None:
    specs = build_dataset(DatasetConfig(num_requests=5, input_len=7, output_len=2))
    assert {len(s.prompt) for s in specs} == {7}
    assert {s.output_len for s in specs} == {2}


def test_vocab_bounds() -> None:
    specs = build_dataset(DatasetConfig(num_requests=20, input_len=50, vocab_min=10, vocab_max=12))
    assert {t for s in specs for t in s.prompt} == {10, 11, 12}


def test_shared_prefix() -> None:
    cfg = DatasetConfig(name="shared-prefix", num_requests=9, num_prefixes=3, prefix_len=16, input_len=4)
    specs = build_dataset(cfg)
    prefixes = [tuple(s.prompt[:16]) for s in specs]
    assert len(set(prefixes)) == 3
    assert prefixes[0] == prefixes[3] == prefixes[6]
    assert all(len(s.prompt) == 20 for s in specs)
    assert len({tuple(s.prompt[16:]) for s in specs}) == 9


def test_lengths_file_json_and_jsonl(tmp_path: Path) -> None:
    j = tmp_path / "pairs.json"
    j.write_text(json.dumps([[5, 2], {"input_len": 3, "output_len": 4}]))
    specs = build_dataset(DatasetConfig(name="lengths-file", path=str(j), num_requests=5))
    assert [(len(s.prompt), s.output_len) for s in specs] == [(5, 2), (3, 4), (5, 2), (3, 4), (5, 2)]
    jl = tmp_path / "pairs.jsonl"
    jl.write_text('{"prompt_len": 6, "completion_tokens": 1}\n\n{"input_length": 2, "output_length": 9}\n')
    specs = build_dataset(DatasetConfig(name="lengths-file", path=str(jl), num_requests=2))
    assert [(len(s.prompt), s.output_len) for s in specs] == [(6, 1), (2, 9)]


def test_trace_replay(tmp_path: Path) -> None:
    t = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 2000, "input_length": 6, "output_length": 2, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 5, "output_length": 3, "hash_ids": [1]},
        {"timestamp": 1500, "input_length": 4, "output_length": 1},
    ]
    t.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DatasetConfig(
        name="trace",
        path=str(t),
        num_requests=10,
        trace_time_unit="ms",
        trace_speedup=2.0,
        trace_block_size=4,
    )
    specs = build_dataset(cfg)
    assert [s.arrival_s for s in specs] == pytest.approx([0.0, 0.25, 0.5])
    assert [(len(s.prompt), s.output_len) for s in specs] == [(5, 3), (4, 1), (6, 2)]
    # equal hash ids give equal blocks: both prompts start with block 1
    assert specs[0].prompt[:4] == specs[2].prompt[:4]


@pytest.mark.parametrize(
    ("cfg", "content"),
    [
        (DatasetConfig(name="nope"), None),
        (DatasetConfig(num_requests=0), None),
        (DatasetConfig(range_ratio=1.0), None),
        (DatasetConfig(input_len=0), None),
        (DatasetConfig(vocab_min=10, vocab_max=5), None),
        (DatasetConfig(name="lengths-file"), None),
        (DatasetConfig(name="lengths-file", path="{tmp}/missing.json"), None),
        (DatasetConfig(name="lengths-file", path="{tmp}/f"), "[[1, 0]]"),
        (DatasetConfig(name="lengths-file", path="{tmp}/f"), '[{"input_len": 3}]'),
        (DatasetConfig(name="lengths-file", path="{tmp}/f"), "{not json"),
        (DatasetConfig(name="lengths-file", path="{tmp}/f"), "[]"),
        (DatasetConfig(name="trace", path="{tmp}/f"), '{"input_len": 3, "output_len": 1}'),
        (DatasetConfig(name="trace", path="{tmp}/f", trace_time_unit="h"), '{"timestamp": 0}'),
    ],
)
def test_bad_datasets(tmp_path: Path, cfg: DatasetConfig, content: str | None) -> None:
    if cfg.path:
        path = cfg.path.format(tmp=tmp_path)
        cfg = replace(cfg, path=path)
        if content is not None:
            Path(path).write_text(content)
    with pytest.raises(DatasetError):
        build_dataset(cfg)
