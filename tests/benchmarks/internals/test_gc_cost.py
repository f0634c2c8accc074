"""``benchmarks/internals/gc_cost.py``: each mode sets the collector as it says (the load run itself
is measured by hand; numbers in benchmarks/README.md)."""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "internals" / "gc_cost.py"


@pytest.fixture
def gc_cost() -> Iterator[Any]:
    spec = importlib.util.spec_from_file_location("gc_cost", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    try:
        yield module
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
        if enabled:
            gc.enable()


@pytest.mark.parametrize(("mode", "threshold", "frozen", "enabled"), [
    ("default", None, False, True),
    ("off", None, False, False),
    ("t5000_10_10", (5000, 10, 10), False, True),
    ("t_f_20000_11_12", (20000, 11, 12), True, True),
    ("tf_20000_10_10", (20000, 10, 10), True, True),
])
def test_each_mode_sets_the_collector(gc_cost: Any, mode: str, threshold: tuple[int, int, int] | None,
                                      frozen: bool, enabled: bool) -> None:
    gc.unfreeze()
    before = gc.get_threshold()
    gc_cost.settle(mode)
    assert gc.get_threshold() == (threshold or before)
    assert (gc.get_freeze_count() > 0) is frozen
    assert gc.isenabled() is enabled


def test_an_unknown_mode_is_refused(gc_cost: Any) -> None:
    with pytest.raises(SystemExit, match="unknown mode"):
        gc_cost.settle("fast")
