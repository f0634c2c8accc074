"""What the proxy reports: Prometheus metrics, traces, the request table, diagnostics, and the
local-prefill alarm."""
