"""pd-sim: a simulated vLLM 0.32 worker (prefill, decode or aggregated) for the P/D proxy.

``build_app(SimSettings(...))`` gives the aiohttp application; ``pd-sim`` (``workers.sim.cli``)
serves it. See ``workers/sim/README.md`` for endpoints, flags and faults.
"""

from .admin import state_snapshot
from .server import build_app
from .settings import Faults, Role, SimSettings
from .state import SIM, SimState

__all__ = ["SIM", "Faults", "Role", "SimSettings", "SimState", "build_app", "state_snapshot"]
