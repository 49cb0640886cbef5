"""benchmarks.kv_routing's in-process part: it runs, and every turn goes where its history is cached."""

from __future__ import annotations

from benchmarks.kv_routing import decision_cost


def test_decision_cost_routes_every_turn_to_its_history() -> None:
    result = decision_cost(conversations=50, decisions=100)
    assert result["placed_on_history_share"] == 1.0
    # 50 histories of 768 tokens (48 blocks of 16, the first 16 shared by all) on their D and on P: 32 blocks of
    # their own each, twice; each turn (routed LOCAL: 64 new tokens < 256) adds 4 new blocks on its D
    own = 2 * 50 * 32 + 100 * 4
    assert own + 16 * 2 <= result["index_blocks"] <= own + 16 * 3
    assert result["decision_us"]["p99"] >= result["decision_us"]["p50"] > 0
