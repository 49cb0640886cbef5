"""The simulator against queueing closed forms and hand-checkable decode cases."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from planner import simulator
from planner.profile import DecodePoint, Profile

PROFILE = Profile(
    prefill_max_tokens_per_s=1000.0,
    ttft_overhead_s=0.0,
    decode=[DecodePoint(1, 0.010), DecodePoint(4, 0.012), DecodePoint(16, 0.020)],
)


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_prefill_matches_mm1_closed_form(rho: float) -> None:
    # isl 100 at 1000 tok/s: mu = 10 req/s; M/M/1 mean sojourn 1 / (mu - lambda).
    mu = 10.0
    requests = simulator.poisson_requests(rho * mu, 100_000, isl=100, osl=1, seed=3)
    ttft, tpot = simulator.simulate(PROFILE, requests, 1, 1, prefill_service="exp", seed=3)
    assert ttft.mean() == pytest.approx(1 / (mu - rho * mu), rel=0.05)
    assert np.isnan(tpot).all()  # one-token outputs never decode


def test_prefill_matches_md1_closed_form_with_overhead() -> None:
    # Deterministic service D = 0.1 s at rho 0.7: W = D + rho D / (2 (1 - rho)) = 0.21667 s, plus 0.05 s overhead.
    profile = Profile(1000.0, 0.05, PROFILE.decode)
    requests = simulator.poisson_requests(7.0, 100_000, isl=100, osl=1, seed=5)
    ttft, _ = simulator.simulate(profile, requests, 1, 1, prefill_service="det")
    assert ttft.mean() == pytest.approx(0.05 + 0.1 + 0.7 * 0.1 / (2 * 0.3), rel=0.05)


def test_lone_request_decodes_at_batch_one_speed() -> None:
    requests = simulator.Requests(np.array([0.0]), np.array([100]), np.array([11]))
    ttft, tpot = simulator.simulate(PROFILE, requests, 1, 1)
    assert ttft[0] == pytest.approx(0.1)
    assert tpot[0] == pytest.approx(0.010)


def test_simultaneous_requests_share_a_batch() -> None:
    # Four requests whose first tokens come out together decode as one batch of 4: 12 ms per token.
    requests = simulator.Requests(np.zeros(4), np.full(4, 1), np.full(4, 21))
    profile = Profile(1e9, 0.0, PROFILE.decode)
    _, tpot = simulator.simulate(profile, requests, 4, 1)
    assert tpot == pytest.approx(np.full(4, 0.012), rel=1e-6)
    # Two D instances split them: batch 2, interpolated 10 + (12 - 10) / 3 = 10.667 ms.
    _, tpot = simulator.simulate(profile, requests, 4, 2)
    assert tpot == pytest.approx(np.full(4, 0.010 + 0.002 / 3), rel=1e-6)


def test_max_batch_queues_the_rest() -> None:
    requests = simulator.Requests(np.zeros(2), np.full(2, 1), np.full(2, 11))
    _, tpot = simulator.simulate(Profile(1e9, 0.0, PROFILE.decode), requests, 2, 1, max_batch=1)
    # The second waits for the first's 10 steps: (10 * 10 ms + 10 * 10 ms) / 10 tokens = 20 ms.
    assert sorted(tpot) == pytest.approx([0.010, 0.020])


def test_tpot_curve_interpolates_and_extrapolates() -> None:
    assert simulator.tpot_curve(PROFILE, 2) == pytest.approx(0.010 + 0.002 / 3)
    assert simulator.tpot_curve(PROFILE, 32) == pytest.approx(0.020 + 16 * (0.008 / 12))


def test_summary_and_attainment() -> None:
    ttft = np.array([0.1, 0.2, 0.3, 0.4])
    tpot = np.array([0.01, 0.05, np.nan, 0.01])
    summary = simulator.summarise(
        ttft, tpot, ttft_slo_s=0.35, tpot_slo_s=0.02, prefill_instances=1, decode_instances=1
    )
    assert summary.ttft_attainment == 0.75
    assert summary.tpot_attainment == 0.75
    assert summary.slo_attainment == 0.5
    assert summary.meets("mean") == (True, False)


def test_more_instances_never_hurt() -> None:
    requests = simulator.poisson_requests(8.0, 5000, isl=100, osl=50, seed=1)
    results = simulator.simulate_grid(PROFILE, requests, [(1, 1), (2, 1), (2, 2)], 1.0, 0.02)
    assert results[1].ttft_mean_s < results[0].ttft_mean_s
    assert results[2].tpot_mean_s <= results[1].tpot_mean_s


def test_replayed_lengths(tmp_path: Path) -> None:
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"input": 10, "output": 2}\n\n{"input": 30, "output": 4}\n')
    lengths = simulator.load_lengths(path)
    requests = simulator.poisson_requests(1.0, 1000, 0, 0, seed=0, lengths=lengths)
    assert set(requests.isl.tolist()) == {10, 30}
    assert set(requests.osl.tolist()) == {2, 4}


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "no length samples"), ('{"input": 1}\n', r":1: expected"), ('{"input": 0, "output": 1}\n', ">= 1")],
)
def test_bad_lengths_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "lengths.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        simulator.load_lengths(path)


def test_single_queue_prefill_equals_the_event_simulation() -> None:
    rng = np.random.default_rng(8)
    arrival = np.cumsum(rng.exponential(0.1, 20_000))
    isl = np.maximum(1, rng.lognormal(np.log(80), 0.8, 20_000)).astype(np.int64)
    requests = simulator.Requests(arrival, isl, np.ones_like(isl))
    expected = simulator._prefill(requests, PROFILE, 1, "det", rng)
    got = simulator.single_queue_prefill(arrival, isl / PROFILE.prefill_max_tokens_per_s)
    assert got == pytest.approx(expected, abs=1e-9)


def test_fluid_decode_agrees_with_the_event_simulation() -> None:
    rng = np.random.default_rng(9)
    count = 20_000
    arrival = np.cumsum(rng.exponential(1 / 4, count))  # ~10 concurrent streams of ~165 steps on average
    steps = np.maximum(1, rng.lognormal(np.log(100), 1.0, count)).astype(np.int64)
    exact = (simulator._decode(arrival, steps, PROFILE, 1, None) - arrival) / steps
    fluid = (simulator.fluid_decode(arrival, steps, PROFILE) - arrival) / steps
    assert fluid.mean() == pytest.approx(exact.mean(), rel=0.02)
    assert np.percentile(fluid, [50, 90, 99]) == pytest.approx(np.percentile(exact, [50, 90, 99]), rel=0.03)
