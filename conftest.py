"""Shared pytest fixtures, one plugin module per area so that each stays small."""

import pytest

pytest_plugins = [
    "tests.fixtures_certs",
    "tests.fixtures_sim",
    "tests.fixtures_vllm",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Real-vLLM tests run last (in their own order). The session's vLLM cluster stays up from its
    first use to the end of the run, and three busy CPU workers on a 2-core machine would slow every
    test after them; the timing-sensitive pd-sim suites then flaked."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is not None)
