"""One owner for a request's lifecycle, read with ``ast``: its phase, who holds it, its KV lease,
its abort, its upstream tasks and its end change only through ``Flight``'s methods
(``proxy/walk/flight.py``). No other module of the proxy assigns those fields, and only the owner
opens or closes a request's lease on the ledger (``kv_transfer.leases``, which keeps its own
``Holder`` fields)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from proxy.observe.state import RequestRecord
from proxy.walk.flight import Flight

ROOT = Path(__file__).resolve().parent.parent
OWNER = "proxy/walk/flight.py"
LEDGER = "kv_transfer/leases.py"

RECORD_FIELDS = frozenset({"phase", "prefill_worker", "prefill_choice", "decode_worker", "kv_params", "lease",
                           "abort_source", "on_abort"})
FLIGHT_FIELDS = frozenset({"prefill_task", "prefill_sent", "decode_task", "release_task", "force_end",
                           "kv_blocks", "abandoned", "crashed"})
LIFECYCLE_FIELDS = RECORD_FIELDS | FLIGHT_FIELDS
LEDGER_FIELDS = frozenset({"kv_params", "lease"})
"""What the ledger writes on the request it is handed (``Holder``)."""
LEDGER_CALLS = frozenset({"hold", "close", "decoding", "decode_refused", "ran_out"})
"""``RequestLeases``' methods that open, bound or close one request's lease."""


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        t = found.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            found.extend(t.elts)
        elif isinstance(t, ast.Starred):
            found.append(t.value)
        else:
            flat.append(t)
    return flat


def _names(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def writes(root: Path = ROOT) -> list[str]:
    """Every store to a lifecycle field (``x.phase = ...``, ``setattr(x, "phase", ...)``) and every
    call that opens or closes a lease on the ledger (``leases.hold(...)``) outside the owner, as
    ``path:line what``."""
    out: list[str] = []
    for package in ("proxy", "kv_transfer"):
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == OWNER:
                continue
            allowed = LEDGER_FIELDS if rel == LEDGER else frozenset()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                for t in _targets(node):
                    if isinstance(t, ast.Attribute) and t.attr in LIFECYCLE_FIELDS - allowed:
                        out.append(f"{rel}:{t.lineno} {ast.unparse(t)} =")
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                if isinstance(func, ast.Name) and func.id == "setattr" and len(node.args) > 1 \
                        and isinstance(node.args[1], ast.Constant) and node.args[1].value in LIFECYCLE_FIELDS:
                    out.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
                elif isinstance(func, ast.Attribute) and func.attr in LEDGER_CALLS \
                        and _names(func.value) == "leases" and rel != LEDGER:
                    out.append(f"{rel}:{node.lineno} {ast.unparse(func)}()")
    return out


def test_the_fields_named_are_the_records_and_the_flights() -> None:
    assert RECORD_FIELDS - {f.name for f in dataclasses.fields(RequestRecord)} == set()
    assert FLIGHT_FIELDS - {f.name for f in dataclasses.fields(Flight)} == set()


def test_only_the_flight_changes_a_requests_lifecycle() -> None:
    assert writes() == []


def test_a_store_or_a_ledger_call_outside_the_owner_is_found(tmp_path: Path) -> None:
    for package in ("proxy/walk", "kv_transfer"):
        (tmp_path / package).mkdir(parents=True)
    (tmp_path / OWNER).write_text("def ok(f):\n    f.record.phase = 1\n    f.leases.close(f, 'x')\n")
    (tmp_path / LEDGER).write_text("def hold(h):\n    h.lease = h.kv_params = None\n    h.phase = 2\n")
    (tmp_path / "proxy/walk/other.py").write_text(
        "def bad(f, w):\n"
        "    f.record.phase = 2\n"
        "    x, f.record.decode_worker = 1, w\n"
        "    f.kv_blocks += 1\n"
        "    setattr(f, 'crashed', True)\n"
        "    self.leases.close(f.record, 'pulled')\n"
        "    f.note = 3\n")
    assert writes(tmp_path) == [
        "proxy/walk/other.py:2 f.record.phase =",
        "proxy/walk/other.py:3 f.record.decode_worker =",
        "proxy/walk/other.py:4 f.kv_blocks =",
        "proxy/walk/other.py:5 setattr(f, 'crashed', True)",
        "proxy/walk/other.py:6 self.leases.close()",
        "kv_transfer/leases.py:3 h.phase =",
    ]
