"""Pools that survive: membership, routing policies, health, admission, retries, migration.

Public API re-exported here; the modules behind it are private by convention.
"""

from proxy.pools.admission import DEADLINE_HEADER, Admission, Deadline, WaitQueue, hop_budget
from proxy.pools.breaker import BreakerConfig, CircuitBreaker, CircuitState
from proxy.pools.errors import DeadlineExceeded, NoWorkerAvailable, Overloaded
from proxy.pools.policies import POLICY_NAMES, PickContext, Policy, make_policy
from proxy.pools.pool import LoadWeights, Pool
from proxy.pools.worker import Outcome, ScrapedLoad, Worker

__all__ = [
    "DEADLINE_HEADER",
    "POLICY_NAMES",
    "Admission",
    "BreakerConfig",
    "CircuitBreaker",
    "CircuitState",
    "Deadline",
    "DeadlineExceeded",
    "LoadWeights",
    "NoWorkerAvailable",
    "Outcome",
    "Overloaded",
    "PickContext",
    "Policy",
    "Pool",
    "ScrapedLoad",
    "WaitQueue",
    "Worker",
    "hop_budget",
    "make_policy",
]
