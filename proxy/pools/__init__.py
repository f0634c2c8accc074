"""Worker choice: the workers, routing policies, admission, circuit breakers, stream migration.

Public API re-exported here; the modules behind it are private by convention.
"""

from proxy.pools.admission import DEADLINE_HEADER, Admission, Deadline, WaitQueue, hop_budget
from proxy.pools.breaker import BreakerConfig, CircuitBreaker, CircuitState
from proxy.pools.errors import DeadlineExceeded, NoWorkerAvailable, Overloaded
from proxy.pools.migration import StreamFollower, migration_blocker
from proxy.pools.options import PoolSettings
from proxy.pools.policies import POLICY_NAMES, PickContext, PickNote, Policy, make_policy
from proxy.pools.pool import LoadWeights, Pool, normalize_url
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
    "PickNote",
    "Policy",
    "Pool",
    "PoolSettings",
    "ScrapedLoad",
    "StreamFollower",
    "WaitQueue",
    "Worker",
    "hop_budget",
    "make_policy",
    "migration_blocker",
    "normalize_url",
]
