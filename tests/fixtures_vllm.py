"""Fixtures that run real vLLM workers on CPU (filled in by the foundation work)."""
