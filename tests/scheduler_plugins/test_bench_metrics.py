"""The scheduler benchmark's stall metrics on a hand-made timeline (what the numbers in the docs mean)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from benchmarks.scheduler import Stream, Workload, holds_target, search_static, summarize
from benchmarks.scheduler_report import process_cpu_s


def test_window_gaps_worst_gap_and_ttft() -> None:
    # Two decode streams tick every 0.1 s from t=0..10; the first freezes for 2 s while a long prompt
    # (sent at 5.0, first token at 7.0) prefills.
    steady = Stream(sent=0.0, long=False, token_times=[i * 0.1 for i in range(101)])
    frozen_times = [i * 0.1 for i in range(51)] + [7.0 + i * 0.1 for i in range(31)]
    frozen = Stream(sent=0.0, long=False, token_times=frozen_times)
    long = Stream(sent=5.0, long=True, token_times=[7.0])
    res = summarize([steady, frozen, long], start=0.0, end=10.0)
    assert res["itl_max_ms"] == pytest.approx(2000.0)
    assert res["ttft_long_p50_ms"] == pytest.approx(2000.0)
    assert res["long_prompts"] == 1
    # 179 gaps of 100 ms, one of 2000 ms: the p99 of all gaps hides the freeze, the window p99 does not.
    assert res["itl_p99_ms"] < 200
    assert res["itl_window_p99_ms"] > 1000
    assert res["throughput_tok_s"] == pytest.approx((101 + 82 + 1) / 10.0)


def test_holds_target_needs_both_percentiles() -> None:
    assert holds_target({"itl_window_p99_ms": 90.0, "itl_p99_ms": 95.0}, 100.0)
    assert not holds_target({"itl_window_p99_ms": 120.0, "itl_p99_ms": 95.0}, 100.0)


def test_long_schedule_is_seeded_poisson_with_distinct_prompts() -> None:
    work = Workload("m", 4, 32, 256, 100, long_rate_per_s=0.5, duration_s=200.0, seed=3, max_token_id=4000)
    first, second = work.long_schedule(), work.long_schedule()
    assert [t for t, _ in first] == [t for t, _ in second]
    times = np.array([t for t, _ in first])
    assert np.all(np.diff(times) > 0) and times[-1] <= 200.0
    assert 60 <= len(times) <= 140  # ~100 expected
    assert len({tuple(p) for _, p in first}) == len(first)


def _fake_run(boundary: int, ran: list[int]) -> Callable[[int], dict]:
    """A static run whose gaps hold a 100 ms target up to ``boundary`` tokens and miss it above."""

    def run(budget: int) -> dict:
        ran.append(budget)
        gap = 90.0 if budget <= boundary else 110.0
        return {"itl_window_p99_ms": gap, "itl_p99_ms": gap}

    return run


@pytest.mark.parametrize(
    ("start", "boundary", "expect_runs"), [(64, 48, [64, 48]), (32, 64, [32, 48, 64, 80])]
)
def test_static_search_stops_at_the_boundary(start: int, boundary: int, expect_runs: list[int]) -> None:
    ran: list[int] = []
    results = search_static(_fake_run(boundary, ran), start, 100.0, tries=6)
    assert ran == expect_runs
    assert max(b for b, r in results.items() if holds_target(r, 100.0)) == boundary


def test_static_search_is_bounded_by_tries() -> None:
    ran: list[int] = []
    search_static(_fake_run(16, ran), 128, 100.0, tries=3)
    assert ran == [128, 112, 96]


def test_process_cpu_counts_the_server_and_its_children_by_name() -> None:
    """A child that burned 0.3 s of CPU is counted under its process name, the root under ``api_server``."""
    burn = (
        "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('x')\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", burn + "sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"x\n"  # it has burned its 0.3 s
        cpu = process_cpu_s(os.getpid())
        comm = Path(f"/proc/{child.pid}/comm").read_text().strip()
        assert cpu[comm] >= 0.29
        assert cpu["api_server"] == pytest.approx(sum(os.times()[:2]), abs=0.05)
    finally:
        child.communicate(b"", timeout=30)


def test_a_stream_kept_waiting_for_its_first_token_shows_in_ttft_stream_max() -> None:
    steady = Stream(sent=0.0, long=False, token_times=[i * 0.1 for i in range(101)])
    late = Stream(sent=6.0, long=False, token_times=[7.5, 7.6, 7.7])  # admitted only after the long prompt
    long = Stream(sent=5.0, long=True, token_times=[7.4])
    res = summarize([steady, late, long], start=0.0, end=10.0)
    assert res["ttft_stream_max_ms"] == pytest.approx(1500.0)
    assert res["itl_max_ms"] == pytest.approx(100.0)  # no gap shows the wait


def test_the_streams_ttft_p90_leaves_out_one_outlier() -> None:
    """Ten new streams waiting 100 ms .. 1000 ms and one 9 s (behind a long prompt): the max is the outlier;
    p90 over the 11 waits is the one at rank 0.9 x 10 = 9 from the smallest: 1000 ms."""
    streams = [
        Stream(sent=float(i), long=False, token_times=[i + 0.1 * (i + 1), i + 0.1 * (i + 1) + 0.05])
        for i in range(10)
    ]
    streams.append(Stream(sent=20.0, long=False, token_times=[29.0, 29.05]))
    streams.append(Stream(sent=20.0, long=True, token_times=[28.0]))
    res = summarize(streams, start=0.0, end=30.0)
    assert res["ttft_stream_max_ms"] == pytest.approx(9000.0)
    assert res["ttft_stream_p90_ms"] == pytest.approx(1000.0)
