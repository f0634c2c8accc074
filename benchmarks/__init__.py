"""pd-bench: TTFT/ITL benchmarks for ``POST /inference/v1/generate`` (vLLM or pd-proxy).

Python API (what ``pd-bench`` and ``make demo`` use)::

    from benchmarks import BenchConfig, DatasetConfig, run_benchmark, summary_text
    result = run_benchmark(BenchConfig(url="http://127.0.0.1:8000", max_concurrency=2,
                                       dataset=DatasetConfig(num_requests=20, input_len=128, output_len=16),
                                       result_dir="results/demo"))
    print(summary_text(result))

Cancellation (``BenchConfig(cancel=CancelConfig(rate=0.3, at="before-first-token"),
kv_probes=(prefill_url,))``) runs the same requests twice, without and with cancels, and reports
the survivors' TTFT penalty and how long the probed workers kept the cancelled requests' KV.

pd-bench speaks HTTP only; it imports nothing of ``proxy`` or ``workers`` (``cancel_bench`` starts
them as processes; the micro-benchmarks of the proxy's own code, which import it, live apart in
``benchmarks.internals``).
"""

from benchmarks.cancel import CancelConfig
from benchmarks.datasets import DatasetConfig, RequestSpec
from benchmarks.records import RequestRecord
from benchmarks.runner import (
    BenchConfig,
    BenchResult,
    CompareResult,
    ConfigError,
    RampUp,
    SweepResult,
    TargetNotReady,
    arun_benchmark,
    arun_compare,
    arun_sweep,
    demo_config,
    run_benchmark,
    run_compare,
    run_sweep,
    summary_text,
)

__all__ = [
    "BenchConfig",
    "BenchResult",
    "CancelConfig",
    "CompareResult",
    "ConfigError",
    "DatasetConfig",
    "RampUp",
    "RequestRecord",
    "RequestSpec",
    "SweepResult",
    "TargetNotReady",
    "arun_benchmark",
    "arun_compare",
    "arun_sweep",
    "demo_config",
    "run_benchmark",
    "run_compare",
    "run_sweep",
    "summary_text",
]
