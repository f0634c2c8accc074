"""Shared pytest fixtures, one plugin module per area so that each stays small."""

pytest_plugins = [
    "tests.fixtures_sim",
    "tests.fixtures_vllm",
]
