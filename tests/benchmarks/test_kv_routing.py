"""The routing benchmark's run, tiny: every turn answered, the hit rate read from pd-sim."""

from __future__ import annotations

from benchmarks.kv_routing import Setup, run_policy


async def test_a_tiny_run_answers_every_turn_for_kv_events_and_the_oracle() -> None:
    setup = Setup(prefill=2, decode=1, conversations=3, turns=2, system_len=32, user_len=8, output_len=2,
                  concurrency=2, block_size=4, kv_blocks=128, prefill_per_token_ms=0.0)
    for policy in ("kv_events", "oracle"):
        r = await run_policy(setup, policy)
        assert r["turns"] == 6 and r["failed"] == 0
        assert 0.0 < r["hit_rate"] < 1.0  # later turns and the shared system prompt hit
