"""The ``sitecustomize`` a CPU P/D worker gets (kv_transfer/nixl_progress): NIXL's agent is made
with the progress delay of ``PD_NIXL_PROGRESS_DELAY_US``, in a fresh interpreter, against a stand-in
for NIXL's package laid out as NIXL's (``_api`` using ``from . import _bindings as nixlBind``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kv_transfer.config import NIXL_PROGRESS_DIR, NIXL_PROGRESS_ENV

BINDINGS = """
made = []
class nixlAgentConfig:
    pthrDelay = -1
def nixlAgent(name, config):
    made.append(config.pthrDelay)
    return name
def getAvailPlugins():
    return ["UCX"]
"""

API = """
from . import _bindings as nixlBind
def agent(name):
    config = nixlBind.nixlAgentConfig()
    config.pthrDelay = 0  # as NIXL's own _api does
    return nixlBind.nixlAgent(name, config), nixlBind.getAvailPlugins()
"""

API_WITHOUT_BINDINGS = """
from . import _bindings
def agent(name):
    config = _bindings.nixlAgentConfig()
    config.pthrDelay = 0
    return _bindings.nixlAgent(name, config), _bindings.getAvailPlugins()
"""

RUN = """
import json, nixl_cu12._api as api, nixl_cu12._bindings as bindings
print(json.dumps({"agent": api.agent("a1"), "delays": bindings.made}))
"""


def _run(tmp_path: Path, api: str, delay: str | None, *more_path: Path) -> tuple[dict[str, object], str]:
    package = tmp_path / "nixl_cu12"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "_bindings.py").write_text(BINDINGS)
    (package / "_api.py").write_text(api)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", NIXL_PROGRESS_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (NIXL_PROGRESS_DIR, tmp_path, *more_path))
    if delay is not None:
        env[NIXL_PROGRESS_ENV] = delay
    done = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=60,
                          check=True)  # fmt: skip
    return json.loads(done.stdout), done.stderr


def test_the_agent_is_made_with_the_delay(tmp_path: Path) -> None:
    out, err = _run(tmp_path, API, "1000")
    assert out == {"agent": ["a1", ["UCX"]], "delays": [1000]}  # the rest of the bindings untouched
    assert "NIXL agent a1: progress thread poll delay 1000 us" in err


@pytest.mark.parametrize("delay", [None, "", "0", "soon"])
def test_without_a_delay_nixls_own_setting_stays(tmp_path: Path, delay: str | None) -> None:
    out, err = _run(tmp_path, API, delay)
    assert out["delays"] == [0]
    assert ("not a whole number" in err) == (delay == "soon")


def test_a_nixl_laid_out_otherwise_is_left_alone_and_says_so(tmp_path: Path) -> None:
    out, err = _run(tmp_path, API_WITHOUT_BINDINGS, "1000")
    assert out["delays"] == [0]
    assert "has no nixlBind.nixlAgent" in err


def test_a_sitecustomize_it_hides_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import sys; print('their sitecustomize ran', file=sys.stderr)")
    out, err = _run(tmp_path, API, "1000", theirs)
    assert out["delays"] == [1000]
    assert err.count("their sitecustomize ran") == 1
    assert err.count("progress thread poll delay") == 1  # this one not run twice
