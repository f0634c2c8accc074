"""benchmarks/internals/stream_write.py: both writers write the same stream; the measuring runs."""

from __future__ import annotations

import pytest

from benchmarks.internals import stream_write
from proxy.front_write import FrontStream


async def test_both_writers_write_the_same_stream() -> None:
    assert await stream_write.same_bytes()


async def test_a_stream_written_otherwise_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FrontStream, "write_eof", FrontStream.write)  # no end
    assert not await stream_write.same_bytes()


async def test_it_measures_both_writers() -> None:
    result = await stream_write.measure(50, 10, 2)
    assert list(result) == list(stream_write.WRITERS)
    assert all(r["write_us"] > 0 and r["stream_us"] > 0 for r in result.values())


def test_its_bounds() -> None:
    with pytest.raises(SystemExit):
        stream_write.main(["--writes", "0"])
