"""proxy.fleet.journal: admin changes shared by the processes of ``--workers N`` through one
append-only file, applied by every process in the same order (two "processes" in one test
process; two apps sharing a journal: ``test_admin.py``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from proxy.fleet.journal import FileJournal, change
from proxy.fleet.membership import Pools
from proxy.pools.policies import make_policy
from proxy.pools.pool import Pool

P1, D1, D2 = "http://127.0.0.1:8101", "http://127.0.0.1:8201", "http://127.0.0.1:8202"


def make_pools() -> Pools:
    return Pools([Pool("prefill", [P1]), Pool("decode", [D1])], policy_factory=make_policy)


def urls(pools: Pools, name: str) -> list[str]:
    return sorted(w.url for w in pools[name])


def two_processes(tmp_path: Path) -> tuple[Pools, FileJournal, Pools, FileJournal]:
    path = tmp_path / "journal.jsonl"
    a, b = make_pools(), make_pools()
    return a, FileJournal(path, a), b, FileJournal(path, b)


def test_journal_changes_reach_the_other_process_in_order(tmp_path: Path) -> None:
    a, ja, b, jb = two_processes(tmp_path)
    with ja.changing() as record:
        record(change("add", "decode", D2))
    assert urls(a, "decode") == [D1, D2]  # the caller applies at once
    assert urls(b, "decode") == [D1]
    assert jb.catch_up() == 1
    assert urls(b, "decode") == [D1, D2] and b["decode"].get(D2).sources == {"admin"}  # type: ignore[union-attr]
    # B drains and removes; A learns both, in order
    with jb.changing() as record:
        record(change("drain", "decode", D1, True))
        record(change("remove", "decode", D2))
    assert ja.catch_up() == 2
    assert urls(a, "decode") == [D1] and a["decode"].get(D1).draining  # type: ignore[union-attr]
    with ja.changing() as record:
        record(change("drain", "decode", D1, False))
    jb.catch_up()
    assert not b["decode"].get(D1).draining  # type: ignore[union-attr]
    assert ja.catch_up() == 0 and jb.catch_up() == 0  # nobody applies a change twice
    ja.close()
    jb.close()


def test_journal_caller_catches_up_before_deciding(tmp_path: Path) -> None:
    """B has not polled yet when its call to remove D2 (added through A) arrives: under the lock it
    first applies A's add, so it removes D2 (not a 404) and both end the same."""
    a, ja, b, jb = two_processes(tmp_path)
    with ja.changing() as record:
        record(change("add", "decode", D2))
    with jb.changing() as record:
        assert b["decode"].get(D2) is not None
        record(change("remove", "decode", D2))
    ja.catch_up()
    assert urls(a, "decode") == urls(b, "decode") == [D1]


def test_journal_skips_lines_that_are_not_changes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a, ja, b, jb = two_processes(tmp_path)
    with ja.path.open("ab") as f:
        f.write(b'not json\n{"op":"add","pool":"gpu","url":"http://127.0.0.1:1"}\n[1]\n')
        f.write(b'{"op":"add","pool":"decode","url":"http://u:pw@127.0.0.1:1"}\n')
        f.write(b'{"op":"add","pool":"decode","url":"http://127.0.0')  # torn: its writer died
    with caplog.at_level(logging.ERROR):
        with ja.changing() as record:  # ends the torn line, then appends on a line of its own
            record(change("add", "decode", D2))
        jb.catch_up()
    assert urls(a, "decode") == urls(b, "decode") == [D1, D2]
    assert jb.skipped == 5 and jb.applied == 1
    assert "pw@" not in caplog.text
    ja.close()
    jb.close()


def test_journal_reads_only_whole_lines(tmp_path: Path) -> None:
    _, ja, b, jb = two_processes(tmp_path)
    line = json.dumps(change("add", "decode", D2)).encode()
    with ja.path.open("ab") as f:
        f.write(line[:10])
        f.flush()
        assert jb.catch_up() == 0 and urls(b, "decode") == [D1]
        f.write(line[10:] + b"\n")
    assert jb.catch_up() == 1 and urls(b, "decode") == [D1, D2]
    ja.close()
    jb.close()


def test_a_poll_applies_a_bounded_slice_a_caller_everything(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of changes is spread over several polls (the event loop is never held long); a
    process about to record a change first applies all of them."""
    monkeypatch.setattr("proxy.fleet.journal.READ_LIMIT", 256)
    a, ja, b, jb = two_processes(tmp_path)
    added = [f"http://127.0.0.1:{9000 + i}" for i in range(20)]  # ~70 bytes a line
    with ja.changing() as record:
        for url in added:
            record(change("add", "decode", url))
    first = jb.catch_up(chunks=1)
    assert 0 < first < len(added)
    looks = 1
    while jb.catch_up(chunks=1):
        looks += 1
    assert looks > 2 and urls(b, "decode") == urls(a, "decode") == sorted([D1, *added])
    jc = FileJournal(ja.path, make_pools())  # a third process, behind by the whole burst
    with jc.changing() as record:  # everything applied before it decides
        assert urls(jc.pools, "decode") == sorted([D1, *added])
        record(change("remove", "decode", D1))
    assert urls(jc.pools, "decode") == sorted(added)
    for j in (ja, jb, jc):
        j.close()
