"""``benchmarks/internals/speed_rule.py``: each variant turns its mechanism off by replacing what the
proxy has now (a mechanism gone, its variant goes too), and the gain is ``1 - base / off`` per
alternation. The load run itself is measured by hand (numbers in benchmarks/README.md)."""

from __future__ import annotations

import pytest

from benchmarks.internals import speed_rule


@pytest.mark.parametrize("variant", [v for v in speed_rule.VARIANTS if v != "base"])
def test_each_variant_turns_something_off(variant: str) -> None:
    patches = speed_rule.patches(variant)
    extra_args = speed_rule.VARIANTS[variant][1]
    assert patches or extra_args
    for owner, name, value in patches:
        assert getattr(owner, name) is not value  # it replaces what is there


def test_the_base_turns_nothing_off() -> None:
    assert speed_rule.patches("base") == [] and speed_rule.VARIANTS["base"][1] == ()


def test_the_gain_is_the_share_of_the_plain_paths_cpu_saved() -> None:
    cpu = {"base": [0.9, 1.0], "no-x": [1.0, 1.0]}
    assert speed_rule.gains(cpu) == {"no-x": [pytest.approx(0.1), 0.0]}
