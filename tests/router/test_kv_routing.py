"""KV-aware routing: the cost at its boundaries, D placement and P choice by cached prefix, the policy on the
uncached tokens, and a router in front of fake engines routing a multi-turn conversation where it is cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.balancer import Balancer
from router.config import CircuitConfig, KvRoutingConfig, PolicyConfig
from router.policy import CacheCost, PolicyInput, PoolLoad, Route, ThresholdPolicy
from tests.router.conftest import MODEL, make_balancer, write_word_tokenizer

IDLE = PoolLoad(workers=2)
KV = KvRoutingConfig(block_size=4, max_blocks_per_worker=1000, load_tokens=10)


# ---- the policy on uncached tokens ------------------------------------------------------------------------


def _decide(prompt: int, cached: int, decode: PoolLoad = IDLE) -> tuple[Route, str]:
    policy = ThresholdPolicy(PolicyConfig(threshold_tokens=100, decode_max_active=10))
    d = policy.decide(PolicyInput(prompt, IDLE, decode, True, cached))
    return d.route, d.reason


def test_a_long_prompt_mostly_cached_at_d_stays_local() -> None:
    assert _decide(4000, 3901) == (Route.LOCAL, "cached")  # 99 uncached < 100
    assert _decide(4000, 3900) == (Route.DISAGG, "long")  # 100 uncached: P computes them
    assert _decide(4000, 0) == (Route.DISAGG, "long")
    assert _decide(99, 0) == (Route.LOCAL, "short")  # short whatever the cache
    assert _decide(4000, 5000) == (Route.LOCAL, "cached")  # a stale over-count never goes negative


def test_the_load_override_still_applies_before_the_cache() -> None:
    assert _decide(4000, 3990, PoolLoad(2, 0, 10)) == (Route.WAIT, "decode_saturated")


def test_cache_cost_at_its_boundaries() -> None:
    cost = CacheCost(load_tokens=10)
    # 3900 of 4000 cached with 10 active (100 + 100) vs nothing cached and idle (4000)
    assert cost.decode(4000, 3900, 10) == 200 < cost.decode(4000, 0, 0)
    # one active request weighs load_tokens: 10 more active cancel 100 cached tokens exactly
    assert cost.decode(1000, 100, 10) == cost.decode(1000, 0, 0)
    assert cost.decode(100, 400, 0) == 0
    assert cost.prefill(1000, 600, 500) == 900 < cost.prefill(1000, 0, 0) + 1
    assert CacheCost(load_tokens=0).decode(1000, 4, 10_000) < CacheCost(load_tokens=0).decode(1000, 0, 0)


# ---- placement -------------------------------------------------------------------------------------------


def _balancer(n_d: int = 3, n_p: int = 2, kv: KvRoutingConfig | None = KV) -> Balancer:
    return make_balancer(n_p, n_d, CircuitConfig(), 3, kv=kv)


def test_decode_holding_the_prefix_wins_until_its_load_outweighs_it() -> None:
    b = _balancer()
    d0, d1, d2 = b.decode.workers
    turn1 = list(range(40))  # 10 blocks of 4
    b.record(b.hashes(turn1), d1)
    turn2 = b.hashes(turn1 + [99] * 12)
    placed = b.place_decode(100, frozenset(), turn2, 52)
    assert (placed.worker, placed.cached_tokens, placed.reason) == (d1, 40, "prefix")
    # cost d1 = 12 + 10 * active; others 52: d1 wins while active <= 3, loses (to an idle one) at 5
    d1.active = 3
    assert b.place_decode(100, frozenset(), turn2, 52).worker is d1
    d1.active = 5
    placed = b.place_decode(100, frozenset(), turn2, 52)
    assert placed.worker in (d0, d2) and (placed.cached_tokens, placed.reason) == (0, "load")
    d1.active = 0
    # saturated, excluded (a failed attempt) or draining: not a candidate, whatever it holds
    assert b.place_decode(100, {d1}, turn2, 52).worker is not d1
    d1.draining = True
    assert b.place_decode(100, frozenset(), turn2, 52).worker is not d1


def test_no_match_anywhere_falls_back_to_two_choices() -> None:
    b = _balancer(n_d=2)
    d0, d1 = b.decode.workers
    d0.active = 1
    for _ in range(20):  # the pair is always {d0, d1}: the less loaded one
        placed = b.place_decode(100, frozenset(), b.hashes(list(range(40))), 40)
        assert (placed.worker, placed.reason, placed.cached_tokens) == (d1, "balance", 0)


def test_prefill_prefers_the_one_holding_the_prefix_unless_it_is_busier_by_more() -> None:
    b = _balancer(n_d=1)
    p0, p1 = b.prefill.workers
    prompt = list(range(100))
    b.record(b.hashes(prompt[:80]), p1)
    hashes = b.hashes(prompt)
    assert b.pick_prefill(frozenset(), hashes, 100) is p1  # 20 uncached vs 100
    p1.outstanding_tokens = 80  # 100 vs 100: tie on cost, then on legs, then random
    assert {b.pick_prefill(frozenset(), hashes, 100) for _ in range(30)} == {p0, p1}
    p1.outstanding_tokens = 81
    assert b.pick_prefill(frozenset(), hashes, 100) is p0


def test_off_means_no_index_and_no_hashes() -> None:
    b = _balancer(kv=KvRoutingConfig(enabled=False))
    assert b.prefixes is None and b.hashes(list(range(100))) == []
    d = b.decode.workers[0]
    b.record([1, 2], d)  # nothing to record into: a no-op
    assert b.place_decode(100, frozenset(), [], 100).reason == "balance"


def test_a_removed_worker_is_forgotten() -> None:
    b = _balancer(n_d=2)
    d0 = b.decode.workers[0]
    b.record(b.hashes(list(range(40))), d0)
    assert b.prefixes is not None and b.prefixes.blocks() == 10
    b.remove(d0.url, "decode")
    assert b.prefixes.blocks() == 0


# ---- a router in front of fake engines --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Word-level, with a token per word ``w0``..``w1999`` (the shared one maps every word to [UNK], and
    distinct conversations would hash alike)."""
    root = tmp_path_factory.mktemp("kv_tokenizer")
    words = [
        "[UNK]",
        "<s>",
        "</s>",
        "<|",
        "|>",
        "user",
        "assistant",
        "system",
        *(f"w{i}" for i in range(2000)),
    ]
    return write_word_tokenizer(root, words)


def _words(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


def _served_by(c, prompt_end: str) -> list[tuple[str, int]]:
    """(role, index) of every engine that got a request whose prompt ends with ``prompt_end``."""
    found = []
    for role, engines in (("prefill", c.prefill), ("decode", c.decode)):
        for i, e in enumerate(engines):
            found += [
                (role, i) for r in e.requests if str(r.get("prompt", r.get("messages"))).endswith(prompt_end)
            ]
    return found


def _metric(text: str, line_start: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


async def _complete(c, prompt: str) -> str:
    r = await c.router.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status == 200
    return r.headers["X-PD-Route"]


async def test_a_conversation_follows_its_prefix_and_goes_local_when_little_is_new(make_cluster) -> None:
    c = await make_cluster(
        n_prefill=1, n_decode=3, kv_routing__enabled=True, kv_routing__block_size=4, kv_routing__load_tokens=4
    )
    turn1 = _words(0, 64)  # 64 tokens (16 blocks): P->D (threshold 32)
    assert await _complete(c, turn1) == "disagg"
    ((_, p), (_, d)) = _served_by(c, "w63")
    turn2 = turn1 + " " + _words(500, 10)  # 64 of 74 tokens are cached at D: 10 new
    assert await _complete(c, turn2) == "local"
    assert _served_by(c, "w509") == [("decode", d)]
    turn3 = turn2 + " " + _words(600, 40)  # 40+ new tokens: P->D again, same D, P that holds the prefix
    assert await _complete(c, turn3) == "disagg"
    assert sorted(_served_by(c, "w639")) == [("decode", d), ("prefill", p)]

    text = await (await c.router.get("/metrics")).text()
    assert (
        _metric(text, 'pd_router_requests_total{endpoint="/v1/completions",reason="cached",route="local"}')
        == 1
    )
    assert _metric(text, 'pd_router_prefix_hit_tokens_total{route="local"}') == 64
    assert _metric(text, 'pd_router_prefix_hit_tokens_total{route="disagg"}') == 72  # turn 2's 18 full blocks
    assert _metric(text, 'pd_router_prefix_lookup_tokens_total{route="disagg"}') == 64 + 114
    assert _metric(text, 'pd_router_decode_placements_total{reason="prefix"}') == 2
    assert _metric(text, 'pd_router_decode_placements_total{reason="balance"}') == 1
    # turn 3's blocks (which include its prefixes') on P and on D
    assert _metric(text, "pd_router_prefix_index_blocks") == 28 + 28
    assert _metric(text, "pd_router_prefix_index_bytes") > 0


async def test_a_chat_follows_its_prefix_through_the_template(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=3, kv_routing__enabled=True, kv_routing__block_size=4)
    messages = [{"role": "system", "content": _words(0, 60)}, {"role": "user", "content": "w100"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    r = await c.router.post("/v1/chat/completions", json=body)
    assert r.status == 200 and r.headers["X-PD-Route"] == "disagg"
    d = next(i for i, e in enumerate(c.decode) if e.requests)
    messages += [{"role": "assistant", "content": "w7 w8"}, {"role": "user", "content": "w101"}]
    r = await c.router.post("/v1/chat/completions", json=body)
    assert r.status == 200 and r.headers["X-PD-Route"] == "local"
    assert len(c.decode[d].requests) == 2 and sum(len(e.requests) for e in c.decode) == 2


async def test_off_routes_on_whole_prompts(make_cluster) -> None:
    c = await make_cluster(n_prefill=1, n_decode=2, kv_routing__enabled=False)
    turn1 = _words(0, 64)
    assert await _complete(c, turn1) == "disagg"
    assert await _complete(c, turn1 + " " + _words(500, 10)) == "disagg"
    text = await (await c.router.get("/metrics")).text()
    assert "pd_router_prefix_index_blocks" not in text
    assert _metric(text, "pd_router_prefix_lookup_tokens_total") == 0
