"""Arrival schedules and the driver (counts, caps, cancellation; no timing assertions)."""

from __future__ import annotations

import asyncio
import io
import math

import numpy as np
import pytest

from benchmarks.datasets import RequestSpec
from benchmarks.loadgen import Job, Progress, arrival_offsets, drive
from benchmarks.records import RequestRecord


def test_offsets_shapes() -> None:
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    assert arrival_offsets(4, 2.0, math.inf) == [0.0, 0.5, 1.0, 1.5]
    a = arrival_offsets(100, 5.0, 1.0, seed=1)
    assert a == arrival_offsets(100, 5.0, 1.0, seed=1)
    assert a != arrival_offsets(100, 5.0, 1.0, seed=2)
    assert a[0] == 0.0 and a == sorted(a) and len(a) == 100
    assert arrival_offsets(0, 1.0) == []
    for bad in ((3, 0.0, 1.0), (3, 1.0, 0.0), (-1, 1.0, 1.0)):
        with pytest.raises(ValueError):
            arrival_offsets(*bad)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_gaps_have_the_asked_rate_and_shape(burstiness: float) -> None:
    gaps = np.diff(arrival_offsets(20001, 10.0, burstiness, seed=7))
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    # coefficient of variation of a gamma(k) is 1/sqrt(k): bursty below 1, regular above
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def _jobs(n: int, targets: int = 1) -> list[Job]:
    spec = RequestSpec([3, 4], 1)
    return [Job(i, i % targets, spec, 0.0) for i in range(n)]


async def test_drive_caps_in_flight_per_target() -> None:
    in_flight: dict[int, int] = {0: 0, 1: 0}
    peak: dict[int, int] = {0: 0, 1: 0}

    async def send(job: Job, t0: float) -> RequestRecord:
        in_flight[job.target] += 1
        peak[job.target] = max(peak[job.target], in_flight[job.target])
        await asyncio.sleep(0.005)
        in_flight[job.target] -= 1
        return RequestRecord(job.index, str(job.index), "t", 2, 1, success=True)

    out = io.StringIO()
    progress = Progress(20, stream=out)
    records, duration = await drive(_jobs(20, targets=2), send, max_concurrency=2, progress=progress)
    assert [r.index for r in records] == list(range(20))
    assert peak == {0: 2, 1: 2}
    assert duration > 0
    assert progress.done == 20
    assert out.getvalue().splitlines()[-1].startswith("pd-bench [##############################] 20/20 ok 20")


async def test_cancelling_drive_cancels_requests_in_flight() -> None:
    started = asyncio.Event()
    cancelled: list[int] = []

    async def send(job: Job, t0: float) -> RequestRecord:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(job.index)
            raise
        raise AssertionError("not reached")

    task = asyncio.create_task(drive(_jobs(3), send))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cancelled) == [0, 1, 2]


async def test_drive_rejects_bad_concurrency() -> None:
    async def send(job: Job, t0: float) -> RequestRecord:
        raise AssertionError

    with pytest.raises(ValueError):
        await drive(_jobs(1), send, max_concurrency=0)
