"""benchmarks.nixl_progress: what it refuses before starting any worker (its runs need real vLLM:
`python -m benchmarks.nixl_progress --model .cache/tiny-llama`, figures in benchmarks/README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import nixl_progress


@pytest.mark.parametrize(
    "extra",
    [["--rounds", "0"], ["--requests", "0"], ["--idle-seconds", "0"], ["--delays", "1000,-1"]],
)
def test_bad_settings_are_refused_before_any_worker_starts(
    extra: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def started(*_: object) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(nixl_progress, "measure", started)
    with pytest.raises(SystemExit) as exc:
        nixl_progress.main(["--model", str(tmp_path), *extra])
    assert exc.value.code == 2


def test_spent_is_per_role() -> None:
    assert nixl_progress._spent({"prefill": 1.0, "decode": 2.0}, {"prefill": 1.5, "decode": 4.0}) == {
        "prefill": 0.5, "decode": 2.0}
