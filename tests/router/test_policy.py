"""The threshold policy at its boundaries (pure function of PolicyInput)."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from router.config import PolicyConfig
from router.policy import PolicyInput, PoolLoad, Route, ThresholdPolicy

CFG = PolicyConfig(
    threshold_tokens=100, prefill_saturated_tokens=1000, decode_max_active=10, decode_headroom_fraction=0.5
)
P_IDLE = PoolLoad(workers=2, min_outstanding_tokens=0, min_active=0)
D_IDLE = PoolLoad(workers=2, min_outstanding_tokens=0, min_active=0)


def decide(
    tokens: int,
    prefill: PoolLoad = P_IDLE,
    decode: PoolLoad = D_IDLE,
    one_sequence: bool = True,
    decode_prefills: bool = True,
    cfg: PolicyConfig = CFG,
):
    return ThresholdPolicy(cfg, decode_prefills).decide(PolicyInput(tokens, prefill, decode, one_sequence))


def test_threshold_boundary() -> None:
    assert decide(99).route is Route.LOCAL and decide(99).reason == "short"
    assert decide(100).route is Route.DISAGG and decide(100).reason == "long"
    assert decide(0).route is Route.LOCAL


LEND = msgspec.structs.replace(CFG, lend_max_active=3)


def lendable(active: int | None) -> PoolLoad:
    """One P whose prefill legs are all done (``active`` requests, lent ones) or, with None, still running."""
    return PoolLoad(
        workers=1, min_outstanding_tokens=0 if active is not None else 500, lendable_min_active=active
    )


def test_lent_only_to_a_prefill_worker_less_loaded_than_every_decode_worker() -> None:
    d_busy = PoolLoad(workers=2, min_active=2)
    assert decide(99, lendable(1), d_busy, cfg=LEND).reason == "lent"
    assert decide(99, lendable(1), d_busy, cfg=LEND).route is Route.LOCAL
    assert decide(99, lendable(2), d_busy, cfg=LEND).reason == "short"  # as busy as the least loaded D: D
    assert decide(99, lendable(0), PoolLoad(workers=2), cfg=LEND).reason == "short"  # idle D: P stays clean


def test_lending_stops_at_lend_max_active_and_while_a_prefill_runs_and_is_off_by_default() -> None:
    d_busy = PoolLoad(workers=2, min_active=9)
    assert decide(99, lendable(2), d_busy, cfg=LEND).reason == "lent"
    assert decide(99, lendable(3), d_busy, cfg=LEND).reason == "short"  # lend_max_active = 3
    assert decide(99, lendable(None), d_busy, cfg=LEND).reason == "short"  # every P is prefilling
    assert decide(99, lendable(0), d_busy).reason == "short"  # lend_max_active = 0 (the default)
    assert decide(100, lendable(0), d_busy, cfg=LEND).reason == "long"  # only short prompts are lent
    assert decide(5000, lendable(0), d_busy, one_sequence=False, cfg=LEND).reason == "fan_out"


def test_several_sequences_stay_local_whatever_the_length() -> None:
    d = decide(5000, one_sequence=False)
    assert (d.route, d.reason) == (Route.LOCAL, "fan_out")
    assert decide(5000, decode=PoolLoad(2, 0, 10), one_sequence=False).route is Route.WAIT


def test_no_prefill_worker_means_local_prefill() -> None:
    d = decide(5000, prefill=PoolLoad())
    assert (d.route, d.reason) == (Route.LOCAL, "no_prefill")


def test_saturated_prefill_with_decode_headroom_goes_local() -> None:
    busy_p = PoolLoad(workers=2, min_outstanding_tokens=1000)
    assert decide(500, prefill=busy_p, decode=PoolLoad(2, 0, 4)).reason == "prefill_saturated"
    # decode at the headroom boundary (5 of 10): keep disaggregating
    assert decide(500, prefill=busy_p, decode=PoolLoad(2, 0, 5)).route is Route.DISAGG
    # prefill one token below saturation: disaggregate
    assert decide(500, prefill=PoolLoad(2, 999), decode=PoolLoad(2, 0, 0)).route is Route.DISAGG


def test_saturated_decode_waits() -> None:
    assert decide(5, decode=PoolLoad(2, 0, 10)).route is Route.WAIT
    assert decide(5, decode=PoolLoad(2, 0, 9)).route is Route.LOCAL
    assert (decide(5, decode=PoolLoad()).route, decide(5, decode=PoolLoad()).reason) == (
        Route.REJECT,
        "no_decode",
    )


def test_decode_that_cannot_prefill_gets_every_request_through_prefill() -> None:
    """sglang-bootstrap: never LOCAL; no P is a 503, saturated P a wait (429 after the queue timeout)."""
    sglang = {"decode_prefills": False}
    short, no_p, busy_p = decide(5, **sglang), decide(5, prefill=PoolLoad(), **sglang), PoolLoad(2, 1000)
    assert (short.route, short.reason) == (Route.DISAGG, "disagg_only")
    assert (no_p.route, no_p.reason) == (Route.REJECT, "no_prefill")
    saturated = decide(500, prefill=busy_p, decode=PoolLoad(2, 0, 0), **sglang)  # D has headroom: no matter
    assert (saturated.route, saturated.reason) == (Route.WAIT, "prefill_saturated")
    assert decide(500, prefill=PoolLoad(2, 999), **sglang).route is Route.DISAGG
    assert decide(5, decode=PoolLoad(2, 0, 10), **sglang).reason == "decode_saturated"


@given(
    tokens=st.integers(0, 10**6),
    p=st.builds(
        PoolLoad,
        st.integers(0, 4),
        st.integers(0, 10**5),
        st.integers(0, 100),
        st.none() | st.integers(0, 100),
    ),
    d=st.builds(PoolLoad, st.integers(0, 4), st.integers(0, 10**5), st.integers(0, 100)),
    one=st.booleans(),
    decode_prefills=st.booleans(),
    lend=st.integers(0, 8),
)
def test_policy_is_total_and_never_sends_a_request_to_a_missing_pool(
    tokens, p, d, one, decode_prefills, lend
) -> None:
    cfg = msgspec.structs.replace(CFG, lend_max_active=lend)
    decision = decide(tokens, p, d, one, decode_prefills, cfg)
    if decision.reason == "lent":  # a short request, on a P without prefill, below both limits
        assert decision.route is Route.LOCAL and tokens < CFG.threshold_tokens and one
        assert p.lendable_min_active is not None and p.lendable_min_active < min(lend, d.min_active)
    if decision.route is Route.DISAGG:
        assert p.workers > 0
        if decode_prefills:
            assert tokens >= CFG.threshold_tokens and one
        else:  # no local fallback: a saturated P is waited for, not queued behind
            assert p.min_outstanding_tokens < CFG.prefill_saturated_tokens
    if decision.route is Route.LOCAL:
        assert decode_prefills
    if d.workers == 0:
        assert decision.route is Route.REJECT
