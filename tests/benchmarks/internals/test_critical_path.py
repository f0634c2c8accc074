"""``benchmarks/internals/critical_path.py``: the points of a non-stream request's path, in order,
taken on a short run through the proxy in front of real pd-sim processes on 127.0.0.1 (the numbers
are in benchmarks/README.md)."""

from __future__ import annotations

from benchmarks.internals.critical_path import Marks, run, summary


async def test_a_requests_path_is_its_points_in_order_with_the_answer_before_the_accounting() -> None:
    result = await run(110, 4)  # 100 to warm up, 10 measured
    names = list(result["segments"])
    assert names == [
        "request in -> handler starts", "handler starts -> validate", "validate -> validated",
        "validated -> walk", "walk -> sent to P", "sent to P -> P answers",
        "P answers -> P's reply checked", "P's reply checked -> P's reply accepted",
        "P's reply accepted -> decode", "decode -> sent to D", "sent to D -> D answers",
        "D answers -> D's reply handled", "D's reply handled -> answer written", "answer written -> served"]
    assert all(row["n"] == 10 and row["median_us"] > 0 for row in result["segments"].values())
    assert result["worker_waits_us"] > 0 and result["before_answer_us"] > 0
    assert result["after_answer_us"] == result["segments"]["answer written -> served"]["median_us"]


def test_the_sums_split_at_the_answer_and_leave_out_the_waits() -> None:
    marks = Marks()
    for i in range(101):  # the warm-up, then one request: 1 us between points, 5 and 7 us waits
        t = i * 1000_000
        for name, at in [("request in", 0), ("sent", 1), ("answer in", 6), ("answer in", 7), ("sent", 8),
                         ("answer in", 15), ("answer written", 16), ("served", 18)]:
            marks.points.append((name, t + at * 1000))
    result = summary(marks.segments())
    assert list(result["segments"]) == ["request in -> sent to P", "sent to P -> P answers",
                                        "P answers -> sent to D", "sent to D -> D answers",
                                        "D answers -> answer written", "answer written -> served"]
    sums = (result["before_answer_us"], result["worker_waits_us"], result["after_answer_us"])
    assert sums == (4.0, 12.0, 2.0)
