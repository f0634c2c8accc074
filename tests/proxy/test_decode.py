"""DecodeAttempts: the bookkeeping both decodes share (which worker next, the one decode-only
rescue, whose failure is still ambiguous), against a recording engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from proxy.pools import Outcome
from proxy.walk.decode import DecodeAttempts
from proxy.wire.errors import UpstreamError, UpstreamStatusError, UpstreamTimeout

KV_BODY: dict[str, Any] = {"token_ids": [1], "kv_transfer_params": {"remote_host": "p"}}
ONLY_BODY: dict[str, Any] = {"token_ids": [1]}


@dataclass
class Engine:
    attempts: int = 2
    retry: bool = True
    rescue_ok: bool = False
    calls: list[Any] = field(default_factory=list)

    @property
    def pools(self) -> Any:
        return SimpleNamespace(decode_retry=SimpleNamespace(attempts=self.attempts))

    def may_retry(self, f: Any, e: UpstreamError) -> bool:
        return self.retry

    def may_rescue(self, f: Any, e: UpstreamError, body: dict[str, Any]) -> bool:
        return self.rescue_ok  # (the engine's own rule wants P's KV in the body; here: always)

    def attribute_failure(self, f: Any, w: str, body: dict[str, Any], e: UpstreamError, *,
                          outcome: Outcome, suspect: str | None, retry_with_kv: bool) -> tuple[Outcome, Any]:
        self.calls.append(("attribute", w, retry_with_kv, suspect))
        return Outcome.NEUTRAL, (w if retry_with_kv else None)

    async def next_decode(self, f: Any, body: dict[str, Any], tried: list[str], attempt: int,
                          error: UpstreamError) -> tuple[str, dict[str, Any]]:
        self.calls.append(("next", list(tried), attempt, body is KV_BODY))
        return f"d{len(tried) + 1}", body

    async def rescue(self, f: Any, error: UpstreamError, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.calls.append(("rescue",) if body is KV_BODY else ("rescue", body))
        return "rescuer", ONLY_BODY

    def handoff_done(self, f: Any, body: dict[str, Any], suspect: str | None) -> None:
        self.calls.append(("handoff_done", suspect))


def attempts(engine: Engine) -> Any:  # workers are names here
    return DecodeAttempts(engine, SimpleNamespace(), "d1", KV_BODY)  # type: ignore[arg-type]


def err() -> UpstreamError:
    return UpstreamStatusError("decode", "d", 503, b"{}", "application/json")


async def test_a_retry_goes_to_another_worker_with_the_first_body() -> None:
    engine = Engine(attempts=3)
    tries = attempts(engine)
    assert tries.failed(err(), Outcome.FAILURE) is Outcome.NEUTRAL
    assert engine.calls[-1] == ("attribute", "d1", True, None)  # first attempt: the retry settles it
    assert tries.suspect == "d1"
    assert await tries.next(err())
    assert engine.calls[-1] == ("next", ["d1"], 0, True)
    assert (tries.worker, tries.attempt, tries.body) == ("d2", 1, KV_BODY)
    tries.failed(err(), Outcome.FAILURE)
    assert engine.calls[-1] == ("attribute", "d2", False, "d1")  # only the first retry carries the suspicion


async def test_answered_with_ps_kv_settles_the_suspect() -> None:
    engine = Engine()
    tries = attempts(engine)
    tries.failed(err(), Outcome.FAILURE)
    await tries.next(err())
    tries.answered()
    assert engine.calls[-1] == ("handoff_done", "d1")


async def test_the_rescue_is_decode_only_once_then_nothing() -> None:
    engine = Engine(attempts=2, rescue_ok=True)
    tries = attempts(engine)
    tries.attempt = 1  # the retries are spent
    assert await tries.next(err())
    assert engine.calls[-1] == ("rescue",)
    assert (tries.worker, tries.body, tries.rescued, tries.tried) == ("rescuer", ONLY_BODY, True, ["d1"])
    assert not await tries.next(err())  # one rescue per request, whatever the engine says
    tries.answered()  # a decode-only answer tells nothing about P's KV
    assert engine.calls[-1] == ("rescue",) and tries.suspect is None


@pytest.mark.parametrize("retry", [False, True])
async def test_no_next_attempt_when_none_may_follow(retry: bool) -> None:
    engine = Engine(attempts=1 if retry else 3, retry=retry)
    tries = attempts(engine)
    e = UpstreamTimeout("decode", "d", "timed out")
    assert tries.failed(e, Outcome.FAILURE) is Outcome.NEUTRAL
    assert engine.calls[-1][2] is False  # no retry: nothing to settle the blame later
    assert not await tries.next(e)
    assert tries.attempt == 0 and tries.worker == "d1"


async def test_a_migration_moves_the_attempt_and_the_attempts_start_over_from_the_continuation() -> None:
    """After a migration a retry or the rescue takes the continuation (the client has the
    first body's tokens): never the request's first body again."""
    engine = Engine(attempts=2, rescue_ok=True)
    tries = attempts(engine)
    tries.attempt, tries.rescued, tries.suspect = 1, True, "d1"  # the first body's attempts spent
    continuation = {"token_ids": [1, 2, 3], "kv_transfer_params": {"x": 1}}
    tries.move("d9", continuation)
    assert (tries.worker, tries.body, tries.first_body) == ("d9", continuation, continuation)
    assert (tries.attempt, tries.rescued, tries.suspect) == (0, False, None)
    assert await tries.next(err())
    assert engine.calls[-1] == ("next", ["d9"], 0, False) and tries.body is continuation
    tries.attempt = 1
    assert await tries.next(err())
    assert engine.calls[-1] == ("rescue", continuation)
