"""Worker selection, circuit breaker and health streaks (deterministic clock and RNG)."""

from __future__ import annotations

import pytest

from router.balancer import Balancer
from router.config import CircuitConfig, HealthConfig
from router.health import CircuitBreaker, CircuitState, apply_check
from tests.router.conftest import make_balancer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _balancer(n_p: int = 3, n_d: int = 3, clock: Clock | None = None) -> Balancer:
    return make_balancer(n_p, n_d, CircuitConfig(failure_threshold=2, open_s=5.0), 1, clock=clock or Clock())


def test_prefill_picks_least_outstanding_tokens() -> None:
    b = _balancer()
    p0, p1, p2 = b.prefill.workers
    p0.outstanding_tokens, p1.outstanding_tokens, p2.outstanding_tokens = 500, 100, 300
    assert b.pick_prefill() is p1
    assert b.pick_prefill(exclude={p1}) is p2
    p1.healthy = False
    assert b.pick_prefill() is p2


def test_decode_power_of_two_never_picks_the_busiest_of_its_pair() -> None:
    b = _balancer(n_d=4)
    for i, w in enumerate(b.decode.workers):
        w.active = i * 10
    picks = [b.place_decode(max_active=100).worker for _ in range(400)]
    busiest = b.decode.workers[-1]
    assert busiest not in picks
    assert b.decode.workers[0] in picks
    # every worker but the busiest is chosen sometimes (randomised pairs spread load)
    assert set(picks) == set(b.decode.workers[:3])


def test_decode_respects_capacity_drain_and_health() -> None:
    b = _balancer(n_d=3)
    d0, d1, d2 = b.decode.workers
    d0.active = 5
    d1.draining = True
    d2.healthy = False
    assert b.place_decode(max_active=5).worker is None
    assert b.place_decode(max_active=6).worker is d0


def test_a_lent_request_goes_to_the_least_active_usable_prefill_worker_with_no_prefill_in_flight() -> None:
    b = _balancer(n_p=4)
    p0, p1, p2, p3 = b.prefill.workers
    p0.active, p0.outstanding_tokens = 0, 300  # prefilling: not lendable, however idle otherwise
    p1.active, p2.active, p3.active = 2, 1, 0
    p3.healthy = False
    assert b.prefill.load().lendable_min_active == 1
    placed = b.place_lent()
    assert (placed.worker, placed.reason) == (p2, "lent")
    with b.lease(p1, prefill_tokens=40), b.lease(p2, prefill_tokens=40):
        assert b.prefill.load().lendable_min_active is None
        assert b.place_lent().worker is None


def test_lease_releases_on_error() -> None:
    b = _balancer()
    p = b.prefill.workers[0]
    with pytest.raises(RuntimeError), b.lease(p, prefill_tokens=40):
        assert (p.active, p.outstanding_tokens) == (1, 40)
        raise RuntimeError
    assert (p.active, p.outstanding_tokens) == (0, 0)


def test_circuit_breaker_opens_half_opens_and_closes() -> None:
    clock = Clock()
    cb = CircuitBreaker(CircuitConfig(failure_threshold=2, open_s=5.0), clock)
    cb.record_failure()
    assert cb.allows()
    cb.record_failure()
    assert cb.state is CircuitState.OPEN and not cb.allows()
    clock.now = 4.9
    assert not cb.allows()
    clock.now = 5.0
    assert cb.allows() and cb.state is CircuitState.HALF_OPEN
    cb.acquire()  # the single trial request
    assert not cb.allows()
    cb.record_failure()  # trial failed: open again for another open_s
    assert cb.state is CircuitState.OPEN
    clock.now = 10.0
    assert cb.allows()
    cb.acquire()
    cb.record_success()
    assert cb.state is CircuitState.CLOSED and cb.allows()


def test_open_circuit_removes_worker_from_candidates() -> None:
    clock = Clock()
    b = _balancer(n_d=1, clock=clock)
    (d,) = b.decode.workers
    d.circuit.record_failure()
    d.circuit.record_failure()
    assert b.place_decode(10).worker is None and b.decode.load().workers == 0
    clock.now = 6.0
    assert b.place_decode(10).worker is d


def test_health_streaks() -> None:
    cfg = HealthConfig(unhealthy_after=2, healthy_after=2)
    b = _balancer(n_d=1)
    (w,) = b.decode.workers
    assert not apply_check(w, False, cfg) and w.healthy
    assert apply_check(w, False, cfg) and not w.healthy
    assert not apply_check(w, True, cfg) and not w.healthy
    assert not apply_check(w, False, cfg)
    assert not apply_check(w, True, cfg)
    assert w.recoveries == 0
    assert apply_check(w, True, cfg) and w.healthy
    assert w.recoveries == 1  # brought back once
