"""``benchmarks/internals/cpu_split.py``: perf's report grouped by what ran the samples, and a short
load through the proxy printing its CPU per request (the numbers are in benchmarks/README.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.internals import cpu_split

_SCRIPT = Path(cpu_split.__file__)

# ``perf report --stdio --sort dso --no-children -g none``, trimmed
REPORT = """\
# To display the perf.data header info, please use --header/--header-only options.
#
# Samples: 34K of event 'cpu-clock:pppH'
# Event count (approx.): 8703175000
#
# Overhead  Shared Object
# ........  ..............................................
#
    60.46%  libpython3.11.so.1.0
     9.50%  0e9d1150a0d08f00c6cf__mypyc.cpython-311-x86_64-linux-gnu.so
     9.72%  [kernel.kallsyms]
     3.95%  libc.so.6
     2.63%  _pydantic_core.cpython-311-x86_64-linux-gnu.so
     2.00%  loop.cpython-311-x86_64-linux-gnu.so
     0.60%  _http_parser.cpython-311-x86_64-linux-gnu.so
     0.40%  _multidict.cpython-311-x86_64-linux-gnu.so
     0.31%  libcrypto.so.3
     0.18%  [vdso]
     0.10%  _json.cpython-311-x86_64-linux-gnu.so
     0.05%  _asyncio.cpython-311-x86_64-linux-gnu.so

"""


def test_the_report_is_summed_by_group_largest_first() -> None:
    shares = cpu_split.split(REPORT)
    assert list(shares) == ["cpython", "kernel", "mypyc", "libc", "pydantic-core", "uvloop", "aiohttp-c",
                            "other", "json", "asyncio"]
    assert shares["aiohttp-c"] == pytest.approx(1.0)  # the parser and multidict together
    assert shares["other"] == pytest.approx(0.49)  # libcrypto and the vDSO
    assert sum(shares.values()) == pytest.approx(89.9)  # every sample line once, no header line


@pytest.mark.parametrize(("dso", "group"), [
    ("python3.11", "cpython"),  # a statically linked interpreter
    ("libpython3.12.so.1.0", "cpython"),
    ("_pydantic_core.cpython-311-x86_64-linux-gnu.so", "pydantic-core"),  # not cpython
    ("_http_writer.cpython-311-x86_64-linux-gnu.so", "aiohttp-c"),
    ("libcrypto.so.3", "other"),  # not libc
    ("libc-2.31.so", "libc"),
])
def test_each_shared_object_goes_to_its_group(dso: str, group: str) -> None:
    assert cpu_split.group_of(dso) == group


def test_bad_arguments_and_pinning_on_one_cpu_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        cpu_split.parse(["--requests", "0"])
    with pytest.raises(SystemExit):
        cpu_split.parse(["--rounds", "21"])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    with pytest.raises(SystemExit, match="two CPUs"):
        cpu_split.pin_cpus()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 5})
    assert cpu_split.pin_cpus() == ({0, 1}, {5})


def test_a_short_load_prints_the_cpu_of_each_round_and_the_split() -> None:
    args = ["--requests", "200", "--rounds", "4", "--perf"]  # more rounds than the client's default
    if len(os.sched_getaffinity(0)) >= 2:
        args.append("--pin")
    done = subprocess.run([sys.executable, str(_SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    rounds = re.findall(r"user (\d+) us/request, system (\d+) us/request, (\d+) requests/s", done.stdout)
    assert len(rounds) == 4, done.stdout
    assert all(int(user) > 0 and int(rate) > 0 for user, _, rate in rounds)
    split = re.search(r"samples by what ran them: (.*)", done.stdout)
    why_not = re.search(r"no split: (.+)", done.stdout)
    assert (split is None) != (why_not is None), done.stdout  # the split, or why there is none
    if split is not None:
        assert split.group(1).startswith("cpython ")  # the interpreter runs most of it
