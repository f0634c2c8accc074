"""Which requests a run cancels, when, and what the requests that were not cancelled paid for it.

``--cancel-rate F`` cancels ``round(F x N)`` of the N requests, picked with the seed (the same ones
in every run of the same seed). Each is cancelled

* ``--cancel-at before-first-token``: at a moment drawn uniformly between its send and its
  expected first token. The expectation is the same request's TTFT in the run without
  cancellations (the baseline, on by default), else the median TTFT of the warm-up requests. A
  first token that comes earlier than the moment cancels the request at once (it is then counted
  as cancelled mid-stream: ``cancel_phases`` says where cancels really landed);
* ``--cancel-at mid-stream``: once a number of output tokens drawn uniformly in [1, output - 1]
  arrived;
* ``--cancel-at first-token``: as soon as its first token arrived (behind a P/D router, the moment
  the decode worker may not have registered the request yet);
* ``--cancel-after S``: S seconds after its send, wherever it is then;

by closing its connection (``--cancel-mode disconnect``) or through the target's abort endpoint
(``--cancel-mode abort``). The TTFT penalty compares the requests that were not cancelled with the
same requests in the baseline run (same prompts, same schedule).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from benchmarks.client import CANCEL_MODES, CancelPlan
from benchmarks.datasets import RequestSpec
from benchmarks.metrics import stats
from benchmarks.records import RequestRecord

CANCEL_AT: Final = ("before-first-token", "mid-stream", "first-token")


@dataclass(frozen=True, slots=True)
class CancelConfig:
    """``--cancel-*``: what share of requests to cancel, when and how."""

    rate: float
    at: str | None = None  # one of CANCEL_AT, or None with after_s
    after_s: float | None = None
    mode: str = "disconnect"
    baseline: bool = True
    abort_grace_s: float = 5.0

    def problems(self) -> list[str]:
        out: list[str] = []
        if not 0.0 <= self.rate <= 1.0:
            out.append("--cancel-rate must be within 0..1")
        if (self.at is None) == (self.after_s is None):
            out.append("cancellation needs exactly one of --cancel-at and --cancel-after")
        if self.at is not None and self.at not in CANCEL_AT:
            out.append(f"--cancel-at must be one of {', '.join(CANCEL_AT)}")
        if self.after_s is not None and not self.after_s >= 0:
            out.append("--cancel-after must be >= 0 seconds")
        if self.mode not in CANCEL_MODES:
            out.append(f"--cancel-mode must be one of {', '.join(CANCEL_MODES)}")
        if not self.abort_grace_s > 0:
            out.append("the abort grace time must be positive")
        return out

    @property
    def needs_ttft_reference(self) -> bool:
        return self.at == "before-first-token"


def pick_cancelled(n: int, rate: float, seed: int) -> set[int]:
    """``round(rate x n)`` request indices, the same for the same seed."""
    k = round(rate * n)
    return set(random.Random(f"{seed}:cancel").sample(range(n), k)) if k else set()


def cancel_plans(
    cfg: CancelConfig,
    specs: Sequence[RequestSpec],
    seed: int,
    ttft_ref: Mapping[int, float] | None = None,
    default_ttft: float | None = None,
) -> dict[int, CancelPlan]:
    """The plan of every cancelled request, by index. ``ttft_ref``: each request's TTFT in the
    baseline (seconds); ``default_ttft`` for those without one (the warm-ups' median)."""
    rng = random.Random(f"{seed}:cancel-when")
    plans: dict[int, CancelPlan] = {}
    for i in sorted(pick_cancelled(len(specs), cfg.rate, seed)):
        u = rng.random()
        if cfg.after_s is not None:
            plans[i] = CancelPlan(mode=cfg.mode, after_s=cfg.after_s, abort_grace_s=cfg.abort_grace_s)
        elif cfg.at == "first-token":
            plans[i] = CancelPlan(mode=cfg.mode, after_tokens=1, abort_grace_s=cfg.abort_grace_s)
        elif cfg.at == "mid-stream":
            n_out = specs[i].output_len
            k = 1 + int(u * max(1, n_out - 1))  # uniform in [1, max(1, n_out - 1)]
            plans[i] = CancelPlan(mode=cfg.mode, after_tokens=min(k, max(1, n_out - 1)),
                                  abort_grace_s=cfg.abort_grace_s)
        else:
            ref = (ttft_ref or {}).get(i, default_ttft)
            if ref is None:
                raise ValueError("before-first-token cancels need a TTFT reference (baseline or warm-ups)")
            plans[i] = CancelPlan(mode=cfg.mode, after_s=u * ref, before_first_token=True,
                                  abort_grace_s=cfg.abort_grace_s)
    return plans


def ttft_penalty(
    run: Sequence[RequestRecord], baseline: Sequence[RequestRecord], percentiles: Sequence[float]
) -> dict[str, Any]:
    """The survivors' TTFT against the same requests in the baseline run (milliseconds)."""
    base = {r.index: r.ttft_s for r in baseline if r.success and r.ttft_s is not None}
    pairs = [
        (r.ttft_s, base[r.index])
        for r in run
        if not r.cancelled and r.success and r.ttft_s is not None and r.index in base
    ]
    now = stats([a for a, _ in pairs], percentiles)
    then = stats([b for _, b in pairs], percentiles)
    out: dict[str, Any] = {
        "survivors_compared": len(pairs),
        "baseline_completed": sum(1 for r in baseline if r.success),
        "baseline_failed": sum(1 for r in baseline if not r.success),
        "ttft_penalty_mean_paired_ms": (
            statistics.fmean(a - b for a, b in pairs) * 1000.0 if pairs else None
        ),
        "ttft_penalty_median_ms": (
            None if now is None or then is None else (now.median - then.median) * 1000.0
        ),
    }
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"ttft_penalty_p{word}_ms"] = (
            None if now is None or then is None else (now.percentiles[p] - then.percentiles[p]) * 1000.0
        )
        out[f"baseline_p{word}_ttft_ms"] = None if then is None else then.percentiles[p] * 1000.0
    out["baseline_median_ttft_ms"] = None if then is None else then.median * 1000.0
    return out
