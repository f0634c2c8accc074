"""The pieces of ``benchmarks.body_stall`` that need no processes: the big body and the reading of
the proxy's ITL histogram."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.body_stall import Gaps, _max_bucket, big_body


def test_big_bodies_have_the_size_and_the_ids_asked() -> None:
    pretty = big_body(1 << 20, "pretty", 50_000)
    assert len(pretty) == 1 << 20
    ids = json.loads(pretty)["token_ids"]
    assert len(ids) == 50_000 and all(257 <= i < 515 for i in ids)
    compact = big_body(1 << 20, "compact", 0)
    assert (1 << 20) - 4 <= len(compact) <= 1 << 20
    assert len(json.loads(compact)["token_ids"]) > 200_000


def test_max_bucket_is_the_bound_that_holds_every_new_observation() -> None:
    before = {0.01: 5.0, 0.02: 8.0, 0.05: 9.0, math.inf: 9.0}
    after = {0.01: 15.0, 0.02: 18.0, 0.05: 20.0, math.inf: 20.0}  # one new gap in (0.02, 0.05]
    assert _max_bucket(before, after) == 0.05
    assert _max_bucket(before, {0.01: 15.0, 0.02: 18.0, 0.05: 19.0, math.inf: 19.0}) == 0.01
    assert _max_bucket(before, {**after, 0.05: 19.0, math.inf: 20.0}) == math.inf


def test_gaps_count_only_chunks_that_arrive_in_the_window() -> None:
    g = Gaps()
    a, b = g.stream(), g.stream()
    a += [0.0, 1.0, 1.1, 3.0]
    b += [0.5, 0.6]
    assert g.max_gap(0.9, 1.2) == 1.0
    assert g.max_gap(2.0, 4.0) == 1.9
    assert g.max_gap(0.55, 0.7) == pytest.approx(0.1)
