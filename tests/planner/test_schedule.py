"""Replica schedule: scale-up lead and scale-down hysteresis at their boundaries, and replica start time."""

from __future__ import annotations

import numpy as np
import pytest

from planner import schedule

WINDOW, TICK = 900.0, 60.0
NEED = [1, 1, 5, 5, 2, 2, 2, 2]  # 5 needed from t = 1800 to 3600


def at(counts: np.ndarray, t: float) -> int:
    return int(counts[int(t // TICK)])


@pytest.mark.parametrize(
    ("lead", "first_tick"), [(0.0, 1800.0), (600.0, 1200.0), (630.0, 1200.0), (570.0, 1260.0)]
)
def test_scale_up_lead_boundary(lead: float, first_tick: float) -> None:
    counts = schedule.ordered(NEED, WINDOW, TICK, lead, hold_s=0.0)
    assert at(counts, first_tick - TICK) == 1
    assert at(counts, first_tick) == 5


def test_scale_down_waits_for_the_hold_exactly() -> None:
    counts = schedule.ordered(NEED, WINDOW, TICK, lead_s=600.0, hold_s=1800.0)
    # Wanted fewer from t = 3600 on: still 5 one tick before 3600 + 1800, 2 from then.
    assert at(counts, 5400 - TICK) == 5
    assert at(counts, 5400) == 2
    assert at(schedule.ordered(NEED, WINDOW, TICK, 600.0, hold_s=0.0), 3600) == 2


def test_a_dip_shorter_than_the_hold_keeps_replicas() -> None:
    counts = schedule.ordered([5, 2, 5, 5], WINDOW, TICK, lead_s=0.0, hold_s=1800.0)
    assert counts.min() == 5


def test_scale_down_goes_to_the_most_wanted_during_the_hold() -> None:
    counts = schedule.ordered([6, 2, 4, 1, 1, 1], WINDOW, TICK, lead_s=0.0, hold_s=1800.0)
    assert at(counts, 900 + 1800) == 4  # wanted 2 then 4 during the hold: down to 4, not 2
    assert at(counts, 2700 + 1800) == 1


def test_ready_lags_orders_by_the_start_time_and_drops_at_once() -> None:
    counts = schedule.ordered(NEED, WINDOW, TICK, lead_s=600.0, hold_s=0.0)  # 5 ordered at 1200, 2 at 3600
    times = np.array([1799.0, 1800.0, 3599.0, 3600.0])
    assert schedule.ready(counts, TICK, 600.0, times).tolist() == [1, 5, 5, 2]
    # A start time that is not a whole number of ticks: ready 630 s after the order.
    assert schedule.ready(counts, TICK, 630.0, np.array([1829.0, 1830.0])).tolist() == [1, 5]
    assert schedule.ready(counts, TICK, 0.0, np.array([1199.0, 1200.0])).tolist() == [1, 5]


def test_ready_counts_a_replica_cancelled_while_starting_as_never_ready() -> None:
    counts = np.array([1, 4, 1, 1, 1, 1])  # up for one tick, then down again
    assert schedule.ready(counts, 60.0, 120.0, np.arange(0, 360, 30.0)).max() == 1


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        schedule.ordered([1], WINDOW, TICK, lead_s=-1.0, hold_s=0.0)
    with pytest.raises(ValueError):
        schedule.ready(np.array([1]), TICK, -1.0, np.array([0.0]))
