"""Admin changes shared by every process of ``pd-proxy --workers N``: an append-only file of JSON
lines in the run's private (0700) directory (proxy/README.md, "``--workers N``").

The process taking a call locks the file, applies every line it has not applied yet (so it decides
on the state every process will reach), then appends and applies its change; the others apply new
lines in file order every ``POLL_INTERVAL``. A line that is not a valid change is logged and
skipped. With one process there is no file: the base ``Journal`` only applies the change."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypedDict

from proxy.fleet.membership import ADMIN_SOURCE, Pools
from proxy.pools.pool import normalize_url

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.25
"""How long other processes may lag behind a change (seconds)."""
READ_LIMIT = 64 * 1024
"""Bytes a poll reads at most, so a burst of changes never holds the event loop long; a caller
about to record a change reads everything."""

Op = Literal["add", "remove", "drain"]


class Change(TypedDict):
    op: Op
    pool: str
    url: str
    drain: bool


def change(op: Op, pool: str, url: str, drain: bool = False) -> Change:
    return {"op": op, "pool": pool, "url": url, "drain": drain}


def apply_change(pools: Pools, c: Change) -> None:
    """Apply one change to this process's pools (the caller and every replay alike)."""
    pool = pools[c["pool"]]
    url = c["url"]
    if c["op"] == "add":
        pool.add(url, ADMIN_SOURCE)
    elif c["op"] == "remove":
        pool.remove(url)
    else:
        worker = pool.get(url)
        if worker is not None:
            worker.draining = c["drain"]
            if not c["drain"]:
                pool.queue.wake()


def parse_change(line: bytes, pools: Pools) -> Change:
    """One journal line as a ``Change``; ``ValueError`` when it is not one."""
    obj: Any = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    op, pool, url, drain = obj.get("op"), obj.get("pool"), obj.get("url"), obj.get("drain", False)
    if op not in ("add", "remove", "drain"):
        raise ValueError("unknown op")
    if not isinstance(pool, str) or pool not in pools:
        raise ValueError("unknown pool")
    if not isinstance(url, str) or not isinstance(drain, bool):
        raise ValueError("bad url or drain")
    return change(op, pool, normalize_url(url), drain)


Record = Callable[[Change], None]


class Journal:
    """Where admin changes go. This base: one process, a change is applied here only."""

    def __init__(self, pools: Pools) -> None:
        self.pools = pools

    @contextlib.contextmanager
    def changing(self) -> Iterator[Record]:
        yield lambda c: apply_change(self.pools, c)

    def catch_up(self, chunks: int | None = None) -> int:
        """Apply what other processes recorded since the last look; how many changes."""
        return 0

    def close(self) -> None:
        pass


class FileJournal(Journal):

    def __init__(self, path: Path, pools: Pools) -> None:
        super().__init__(pools)
        self.path = path
        self._fd: int | None = None
        self.offset = 0
        """Bytes of the file this process has applied: always the end of a whole line."""
        self.applied = 0
        self.skipped = 0

    @property
    def fd(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def catch_up(self, chunks: int | None = None) -> int:
        done = 0
        reads = 0
        while chunks is None or reads < chunks:
            reads += 1
            size = os.fstat(self.fd).st_size
            if size <= self.offset:
                return done
            data = os.pread(self.fd, min(size - self.offset, READ_LIMIT), self.offset)
            end = data.rfind(b"\n") + 1
            if end == 0:
                if len(data) < READ_LIMIT:
                    return done  # a line being written: the rest at the next look
                end = len(data)  # READ_LIMIT bytes without a newline are no change of ours: skip
            for line in data[:end].splitlines():
                if line.strip():
                    done += self._apply(line)
            self.offset += end
        return done

    def _apply(self, line: bytes) -> int:
        try:
            c = parse_change(line, self.pools)
        except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError included
            self.skipped += 1
            log.error("admin journal %s: a line that is not a change was skipped (%s)", self.path, e)
            return 0
        apply_change(self.pools, c)
        self.applied += 1
        return 1

    @contextlib.contextmanager
    def changing(self) -> Iterator[Record]:
        """Lock the journal and bring this process up to date; the ``Record`` it yields applies a
        change here and appends it for the others."""
        fd = self.fd
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            self.catch_up()
            if os.fstat(fd).st_size > self.offset:
                # a torn line (its writer died): the next change starts on its own line
                os.write(fd, b"\n")
                self.catch_up()

            def record(c: Change) -> None:
                line = json.dumps(c, separators=(",", ":")).encode() + b"\n"
                os.write(fd, line)
                self.offset += len(line)
                apply_change(self.pools, c)
                self.applied += 1

            yield record
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def make_journal(path: Path | None, pools: Pools) -> Journal:
    return Journal(pools) if path is None else FileJournal(path, pools)


__all__ = ["POLL_INTERVAL", "Change", "FileJournal", "Journal", "apply_change",
           "change", "make_journal", "parse_change"]
