"""Per-request state of the P/D walk and the table of requests in flight.

Each state has a cleanup owner (``proxy.http.serving.Serving.cleanup``): PREFILLING, an abort on P
(or, if P had finished, the KV_HELD rule on its reply); KV_HELD, a decode request carrying P's
params, completed at once (D pulls, P frees); DECODING, an abort on D and closing its connection."""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from kv_transfer.ledger import Lease
from proxy.pools import Worker

__all__ = ["Phase", "RequestRecord", "RequestTable", "TaskTracker", "Worker", "outlive"]

E = TypeVar("E", bound="Entry")
T = TypeVar("T")


class Phase(enum.Enum):
    PREFILLING = "prefilling"
    KV_HELD = "kv_held"
    DECODING = "decoding"
    DONE = "done"


@dataclass(eq=False, slots=True)
class RequestRecord:
    base_id: str
    engine_id: str
    stream: bool
    phase: Phase = Phase.PREFILLING
    prefill_worker: Worker | None = None
    decode_worker: Worker | None = None
    kv_params: dict[str, Any] | None = None
    lease: Lease | None = None
    abort_source: str | None = None
    prefill_choice: str | None = None
    """Why ``kv_events`` chose the prefill worker (``PickNote.describe``), else None."""
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    on_abort: list[Callable[[], None]] = field(default_factory=list)
    """Called once when the request is aborted."""

    @property
    def is_aborted(self) -> bool:
        return self.abort_source is not None

    async def aborted_within(self, seconds: float) -> None:
        """Wait until the request is aborted, at most ``seconds``."""
        if self.is_aborted:
            return
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        self.on_abort.append(wake)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken, seconds)
        finally:
            with contextlib.suppress(ValueError):  # already called (and dropped) on abort
                self.on_abort.remove(wake)

    def holders(self) -> list[Worker]:
        if self.phase is Phase.PREFILLING and self.prefill_worker is not None:
            return [self.prefill_worker]
        if self.phase is Phase.KV_HELD and self.prefill_worker is not None:
            return [self.prefill_worker]
        if self.phase is Phase.DECODING and self.decode_worker is not None:
            return [self.decode_worker]
        return []

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.engine_id,
            "state": self.phase.value,
            "stream": self.stream,
            "prefill_worker": self.prefill_worker.url if self.prefill_worker else None,
            "decode_worker": self.decode_worker.url if self.decode_worker else None,
            "holders": [w.url for w in self.holders()],
            "aborted": self.abort_source,
            "prefill_choice": self.prefill_choice,
        }


class Entry(Protocol):
    """What the table keeps per request: its record and more."""

    @property
    def record(self) -> RequestRecord: ...


class RequestTable(Generic[E]):
    """Requests in flight by the id vLLM knows (several may share an id: vLLM allows it)."""

    def __init__(self) -> None:
        self._by_id: dict[str, list[E]] = {}

    def add(self, entry: E) -> None:
        self._by_id.setdefault(entry.record.engine_id, []).append(entry)

    def remove(self, entry: E) -> None:
        entries = self._by_id.get(entry.record.engine_id)
        if entries is None:
            return
        if entry in entries:
            entries.remove(entry)
        if not entries:
            del self._by_id[entry.record.engine_id]

    def entries(self, engine_id: str) -> list[E]:
        return list(self._by_id.get(engine_id, ()))

    def all_entries(self) -> list[E]:
        return [e for entries in self._by_id.values() for e in entries]

    def get(self, engine_id: str) -> list[RequestRecord]:
        return [e.record for e in self._by_id.get(engine_id, ())]

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_id.values())

    def all(self) -> list[RequestRecord]:
        return [e.record for entries in self._by_id.values() for e in entries]


async def outlive(task: asyncio.Task[T]) -> T:
    """``task``'s result, as ``asyncio.shield`` gives it: cancelling the caller leaves the task
    running."""
    if not task.done():
        woken: asyncio.Future[None] = task.get_loop().create_future()

        def wake(_: object) -> None:
            if not woken.done():
                woken.set_result(None)

        task.add_done_callback(wake)
        try:
            await woken
        finally:
            task.remove_done_callback(wake)  # cancelled: the task goes on, nobody waits
    return task.result()


class TaskTracker:
    """Background tasks the app must finish (cleanups, abort fan-outs) before it closes."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, asked once (``asyncio.get_running_loop`` is a system call on 3.11)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def spawn(self, coro: Any, name: str | None = None) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = self.loop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, limit: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=limit)

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
