"""``StartTimes``: the configured start time until one is measured, then the latest measurement per role; a
scale-down while waiting ends the measurement unmeasured."""

from __future__ import annotations

from pd_disagg.autoscale.policy import Replicas
from pd_disagg.autoscale.startup import StartTimes


def _r(running: int, starting: int = 0) -> dict[str, Replicas]:
    return {"decode": Replicas(running, starting, running + starting)}


def test_a_scale_up_is_timed_until_that_many_run() -> None:
    starts = StartTimes(configured_s=120.0)
    assert starts.lead_s() == 120.0
    starts.ordered("decode", 3, Replicas(1, 0, 1), now=10.0)
    starts.ordered("decode", 3, Replicas(1, 2, 3), now=12.0)  # still the first order's clock
    starts.observe(_r(2, 1), now=50.0)
    assert starts.lead_s() == 120.0  # two of three: not yet
    starts.observe(_r(3), now=90.0)
    assert starts.measured_s == {"decode": 80.0} and starts.lead_s() == 80.0
    starts.ordered("decode", 4, Replicas(3, 0, 3), now=100.0)
    starts.observe(_r(4), now=200.0)
    assert starts.lead_s() == 100.0  # the latest measurement


def test_a_scale_down_below_the_awaited_count_ends_the_measurement() -> None:
    starts = StartTimes(configured_s=60.0)
    starts.ordered("decode", 3, Replicas(1, 0, 1), now=0.0)
    starts.ordered("decode", 2, Replicas(1, 2, 3), now=5.0)
    starts.observe(_r(3), now=500.0)
    assert starts.measured_s == {} and starts.lead_s() == 60.0
    starts.ordered("decode", 1, Replicas(2, 0, 2), now=600.0)  # a scale-down starts nothing
    starts.observe(_r(1), now=601.0)
    assert starts.measured_s == {}
