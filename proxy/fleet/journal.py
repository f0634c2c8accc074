"""Admin changes shared by every process of ``pd-proxy --workers N``.

Each process has its own pools; an admin call (add, remove, drain a worker) reaches one of them.
So that it reaches all, every change goes through a journal: one append-only file of JSON lines
in a directory the parent makes for the run (``tempfile.mkdtemp``: mode 0700, so no other local
user can write a change into it), given to the children as ``PoolSettings.admin_journal``.

* The process that takes a call locks the file (``flock``), first applies every line it has not
  applied yet (so it decides, e.g. a 404 for an unknown worker, on the state every process will
  have reached at that point), then appends its change, applies it at once, and unlocks. The
  section holds no ``await``: it costs microseconds of the event loop (a few small reads and a
  write on a local file).
* Every process reads the lines appended since its last look every ``POLL_INTERVAL`` (0.25 s) and
  applies them in file order (at most ``READ_LIMIT`` bytes per look, so a burst of changes never
  holds the event loop long). Every process applies the same changes in the same order, so their
  admin-declared membership and draining agree within a poll interval.
* A line that is not a valid change (it cannot come from pd-proxy; a process that died while
  writing) is logged and skipped. A torn last line found under the lock is terminated, so that the
  next change starts on a line of its own.

With one process there is no file: the base ``Journal`` applies the change and records nothing.
The journal grows by one short line per admin call (admin calls are authenticated and rare); it
lives as long as the run and the parent removes its directory at exit.
"""

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
"""Seconds between two looks at the journal: how long other processes may lag behind a change."""
READ_LIMIT = 64 * 1024
"""Bytes read at a time: about 800 changes, some 30 ms of the event loop to apply. A poll reads at
most this much (a burst of changes is spread over several polls); a caller about to record a
change reads everything (it must decide on the latest state)."""

Op = Literal["add", "remove", "drain"]


class Change(TypedDict):
    op: Op
    pool: str
    url: str
    drain: bool


def change(op: Op, pool: str, url: str, drain: bool = False) -> Change:
    return {"op": op, "pool": pool, "url": url, "drain": drain}


def apply_change(pools: Pools, c: Change) -> None:
    """Apply one change to this process's pools (the same code for the caller and every replay)."""
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
        """A ``Record`` that applies a change (inside the block: decide and record together)."""
        yield lambda c: apply_change(self.pools, c)

    def catch_up(self, chunks: int | None = None) -> int:
        """Apply what other processes recorded since the last look (at most ``chunks`` reads of
        ``READ_LIMIT`` bytes; None: all of it); how many changes."""
        return 0

    def close(self) -> None:
        pass


class FileJournal(Journal):
    """The journal file shared by the processes of one run (see the module's docstring)."""

    def __init__(self, path: Path, pools: Pools) -> None:
        super().__init__(pools)
        self.path = path
        self._fd: int | None = None
        self.offset = 0
        """Bytes of the file this process has applied (always the end of a whole line)."""
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
        """Apply the whole lines appended since the last look; how many were applied."""
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
        change here and appends it for the others. Unlocked on exit (an exception records nothing
        more)."""
        fd = self.fd
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            self.catch_up()
            if os.fstat(fd).st_size > self.offset:
                # a torn line (its writer died mid-write; nobody writes while we hold the lock):
                # end it, so that the next change starts on its own line
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
