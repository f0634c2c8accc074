"""A circuit breaker per worker: passive ejection on errors (closed -> open -> half-open).

Each re-open without a close in between doubles the open time, up to ``max_open_seconds``. A
half-open trial still running after ``trial_seconds`` no longer holds its slot, so a hung trial
cannot keep a recovered worker out of the pool. Time comes only from the given clock."""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("pd_proxy.pools")


class CircuitState(enum.IntEnum):
    """Values are the ``pd_proxy_circuit_state`` gauge's: 0 closed, 1 half-open, 2 open."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 5
    success_threshold: int = 1
    open_seconds: float = 5.0
    max_open_seconds: float = 60.0
    half_open_trials: int = 1
    trial_seconds: float | None = None
    """A trial running longer than this stops holding its slot (None: ``open_seconds``)."""

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.success_threshold < 1 or self.half_open_trials < 1:
            raise ValueError("breaker thresholds and trials must be at least 1")
        if self.open_seconds <= 0 or self.max_open_seconds < self.open_seconds:
            raise ValueError("breaker open time must be positive and at most max_open_seconds")
        if self.trial_seconds is not None and self.trial_seconds <= 0:
            raise ValueError("breaker trial time must be positive")


class CircuitBreaker:
    def __init__(self, config: BreakerConfig, clock: Callable[[], float], name: str = "") -> None:
        self.config = config
        self.name = name
        self._clock = clock
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._successes = 0
        self._trials: deque[float] = deque()
        """Start times of the trials running, oldest first."""
        self._opened_at = 0.0
        self._open_for = config.open_seconds
        self.opened_count = 0

    @property
    def state(self) -> CircuitState:
        if self._state is CircuitState.OPEN and self._clock() >= self._opened_at + self._open_for:
            self._state = CircuitState.HALF_OPEN
            self._successes = 0
            self._trials.clear()
        return self._state

    def retry_in(self) -> float:
        """Seconds until an open circuit lets a trial through (0 when it is not open)."""
        if self.state is not CircuitState.OPEN:
            return 0.0
        return max(0.0, self._opened_at + self._open_for - self._clock())

    def can_take(self) -> bool:
        # closed: the common case, asked on every pick
        return self._state is CircuitState.CLOSED or self.available_in() == 0.0

    def available_in(self) -> float:
        """Seconds until the circuit lets a request in, if nothing else happens (0: now)."""
        state = self.state
        if state is CircuitState.CLOSED:
            return 0.0
        if state is CircuitState.OPEN:
            return self.retry_in()
        limit = self.config.trial_seconds or self.config.open_seconds
        now = self._clock()
        running = [t for t in self._trials if now - t < limit]
        if len(running) < self.config.half_open_trials:
            return 0.0
        return max(1e-3, running[0] + limit - now)

    def begin(self) -> None:
        """A request was sent to the worker (counts as a trial when half-open)."""
        if self.state is CircuitState.HALF_OPEN:
            self._trials.append(self._clock())

    def record_success(self) -> None:
        state = self.state
        if state is CircuitState.HALF_OPEN:
            self._end_trial()
            self._successes += 1
            if self._successes >= self.config.success_threshold:
                self._close()
        elif state is CircuitState.CLOSED:
            self._failures = 0

    def record_failure(self) -> None:
        state = self.state
        if state is CircuitState.HALF_OPEN:
            self._end_trial()
            self._open(backoff=True)
        elif state is CircuitState.CLOSED:
            self._failures += 1
            if self._failures >= self.config.failure_threshold:
                self._open(backoff=False)

    def record_neutral(self) -> None:
        """A request ended without telling anything about the worker (e.g. client went away)."""
        if self._state is CircuitState.HALF_OPEN:
            self._end_trial()

    def _end_trial(self) -> None:
        if self._trials:
            self._trials.popleft()

    def trip(self) -> None:
        """Open at once (e.g. the active health probe declared the worker dead)."""
        if self.state is not CircuitState.OPEN:
            self._open(backoff=self._state is CircuitState.HALF_OPEN)

    def reset(self) -> None:
        self._close()

    def _open(self, *, backoff: bool) -> None:
        if backoff:
            self._open_for = min(self.config.max_open_seconds, self._open_for * 2)
        else:
            self._open_for = self.config.open_seconds
        self._state = CircuitState.OPEN
        self._opened_at = self._clock()
        self._failures = 0
        self._successes = 0
        self._trials.clear()
        self.opened_count += 1
        if self.name:
            log.warning("circuit of %s opened for %.3g s", self.name, self._open_for)

    def _close(self) -> None:
        if self.name and self._state is not CircuitState.CLOSED:
            log.warning("circuit of %s closed", self.name)
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._successes = 0
        self._trials.clear()
        self._open_for = self.config.open_seconds
