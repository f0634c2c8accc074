"""Loaded by every Python process of a CPU P/D worker; inert unless ``PD_NIXL_PROGRESS_DELAY_US``
is set. NIXL agents are then made with that progress-thread delay instead of a busy poll (0),
which holds a core per worker. A ``sitecustomize`` this one hides is run after it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

# kv_transfer.config.NIXL_PROGRESS_ENV, repeated: the project is not installed where this runs.
ENV = "PD_NIXL_PROGRESS_DELAY_US"
MODULES = ("nixl_cu12._api", "nixl._api")


class _Bindings:
    """NIXL's binding module as ``_api`` sees it, with the agent made with the delay."""

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # NIXL's name
        config.pthrDelay = self._delay_us
        print(
            f"pd-workers: NIXL agent {name}: progress thread poll delay {self._delay_us} us",
            file=sys.stderr,
            flush=True,
        )
        return self._real.nixlAgent(name, config)


def _patch(module: ModuleType, delay_us: int) -> None:
    real = getattr(module, "nixlBind", None)
    if real is None or not hasattr(real, "nixlAgent"):
        print(
            f"pd-workers: {module.__name__} has no nixlBind.nixlAgent; NIXL's progress delay left as it is",
            file=sys.stderr,
            flush=True,
        )
        return
    module.nixlBind = _Bindings(real, delay_us)  # type: ignore[attr-defined]


class _Finder(importlib.abc.MetaPathFinder):
    """Finds NIXL's ``_api`` as the other finders would and patches it once it has run."""

    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module
        delay_us = self.delay_us

        def exec_module(module: ModuleType) -> None:
            run(module)
            _patch(module, delay_us)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Put the finder first when ``PD_NIXL_PROGRESS_DELAY_US`` holds a delay (microseconds, > 0)."""
    value = os.environ.get(ENV, "")
    if not value:
        return
    try:
        delay_us = int(value)
    except ValueError:
        print(f"pd-workers: {ENV}={value!r} is not a whole number; ignored", file=sys.stderr, flush=True)
        return
    if delay_us > 0:
        sys.meta_path.insert(0, _Finder(delay_us))


def run_the_hidden_one() -> None:
    """Run the ``sitecustomize`` that this one hides on ``sys.path``, if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


install()
run_the_hidden_one()
