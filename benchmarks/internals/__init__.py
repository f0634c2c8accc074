"""Micro-benchmarks of pd-proxy's own code, run in-process: what a request body costs
(``body_cost``), what one upstream hop costs the proxy's client (``hop_cost``), and how many Python
function calls a request makes (``call_counts``: counted, not timed).

Unlike pd-bench (the ``benchmarks`` package proper, which speaks HTTP only), these import the
proxy's internals: they time them. Run them as ``python -m benchmarks.internals.<name>``.
"""
