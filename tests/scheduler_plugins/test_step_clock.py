"""A step's cost is its whole cycle when the engine loops on (hand-made timestamps; no engine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scheduler_plugins.config import SchedulerSettings, StepTime, load_settings
from scheduler_plugins.cost_model import CostModel, StepShape, step_shape
from scheduler_plugins.step_clock import (
    MAX_SAMPLES,
    RunQueueWait,
    StepClock,
    StepSample,
    StepStats,
    pinned_cores,
)

SHAPE = StepShape(prefill_tokens=64, decodes=4, attended_context=5000.0)


def test_cycle_runs_to_the_next_begin_when_the_engine_loops_on() -> None:
    clock = StepClock()
    assert clock.begin(now=10.000, cpu=1.0) is None  # nothing measured before the first step
    clock.scheduled(SHAPE, predicted_s=0.050, now=10.002)
    assert clock.updated(forward_end=10.060, now=10.065, cpu=1.05, more_work=True) is None  # not closed yet
    # The API server had the core for 30 ms before the engine began the next step: that is the step's cost.
    sample = clock.begin(now=10.095, cpu=1.06)
    assert sample is not None and sample.shape == SHAPE and sample.predicted_s == 0.050
    assert sample.forward_s == pytest.approx(0.058)
    assert sample.cycle_s == pytest.approx(0.095)
    assert sample.cpu_s == pytest.approx(0.06)
    assert clock.begin(now=10.2, cpu=1.1) is None  # each step is reported once


def test_cycle_ends_at_the_update_when_the_engine_goes_idle() -> None:
    clock = StepClock()
    clock.begin(now=0.0, cpu=0.0)
    clock.scheduled(SHAPE, predicted_s=0.05, now=0.001)
    sample = clock.updated(forward_end=0.040, now=0.042, cpu=0.04, more_work=False)
    assert sample is not None and sample.cycle_s == pytest.approx(0.042)  # the idle wait is not counted
    assert clock.begin(now=5.0, cpu=0.05) is None


def test_an_engine_that_tells_idleness_late_ends_the_cycle_at_the_update() -> None:
    """SGLang's adapter reports every step with more_work=True, and idle() when its loop found nothing."""
    clock = StepClock()
    clock.begin(now=0.0, cpu=0.0)
    clock.scheduled(SHAPE, predicted_s=0.05, now=0.001, wait_s=0.5)
    assert clock.updated(forward_end=0.040, now=0.042, cpu=0.04, more_work=True, wait_s=0.51) is None
    sample = clock.idle()
    assert sample is not None and sample.shape == SHAPE
    assert sample.cycle_s == pytest.approx(0.042) and sample.cpu_s == pytest.approx(0.04)
    assert sample.forward_s == pytest.approx(0.039) and sample.worker_wait_s == pytest.approx(0.01)
    assert clock.idle() is None and clock.begin(now=5.0, cpu=0.05) is None  # reported once


def test_an_empty_step_is_not_measured() -> None:
    clock = StepClock()
    clock.begin(now=0.0, cpu=0.0)
    clock.scheduled(None, predicted_s=0.0, now=0.001)
    assert clock.updated(forward_end=0.002, now=0.003, cpu=0.0, more_work=True) is None
    assert clock.begin(now=0.004, cpu=0.0) is None


def test_stats_summarise_and_reset() -> None:
    clock, stats = StepClock(), StepStats()
    t = 0.0
    for cycle in (0.080, 0.100, 0.120):
        clock.begin(now=t, cpu=t / 2)
        clock.scheduled(SHAPE, predicted_s=0.080, now=t)
        clock.updated(forward_end=t + 0.05, now=t + 0.06, cpu=t / 2, more_work=True)
        t += cycle
        sample = clock.begin(now=t, cpu=t / 2)
        assert sample is not None
        stats.add(sample)
    text = stats.summary()
    assert "steps=3 forward_ms=50.0/50.0 cycle_ms=100.0/120.0 cpu_share=0.50" in text
    assert "cycle/predicted=1.25/1.50" in text
    assert stats.summary() == "steps=0"


def test_step_time_setting() -> None:
    assert SchedulerSettings().step_time is StepTime.CYCLE
    assert load_settings({"PD_SCHED_STEP_TIME": "forward"}, None).step_time is StepTime.FORWARD
    with pytest.raises(ValueError, match="step_time"):
        load_settings({"PD_SCHED_STEP_TIME": "wall"}, None)
    with pytest.raises(ValueError, match="verdict_after_steps"):
        load_settings({"PD_SCHED_VERDICT_AFTER_STEPS": "0"}, None)


def test_cost_model_counts_prefill_steps() -> None:
    model = CostModel()
    model.observe(StepShape(prefill_tokens=0, decodes=4, attended_context=100.0), 0.03)
    model.observe(SHAPE, 0.08)
    model.observe(SHAPE, float("nan"))  # ignored
    assert (model.observations, model.prefill_observations) == (2, 1)


def test_run_queue_wait_reads_the_main_threads(tmp_path: Path) -> None:
    """A fake /proc: workers 7 and 9 (children of 5); 7's spinning side thread 8 is not counted."""
    for pid, tid, waited_ns in ((7, 7, 2_000_000), (7, 8, 900_000_000), (9, 9, 500_000)):
        (tmp_path / str(pid) / "task" / str(tid)).mkdir(parents=True)
        (tmp_path / str(pid) / "task" / str(tid) / "schedstat").write_text(f"123 {waited_ns} 4\n")
    (tmp_path / "5" / "task" / "5").mkdir(parents=True)
    (tmp_path / "5" / "task" / "5" / "children").write_text("7 9")
    assert RunQueueWait.children(5, tmp_path) == [7, 9]
    wait = RunQueueWait([7, 9], tmp_path)
    assert wait.seconds() == pytest.approx(0.0025)
    (tmp_path / "9" / "task" / "9" / "schedstat").unlink()  # a worker ended: counted without it
    assert wait.seconds() == pytest.approx(0.002)
    assert RunQueueWait([99], tmp_path).seconds() == 0.0  # no such process: nothing waited


def test_run_queue_wait_reads_this_process() -> None:
    assert RunQueueWait([os.getpid()]).seconds() >= 0.0


def test_worker_wait_is_the_forward_pass_share_and_reaches_the_summary() -> None:
    clock, stats = StepClock(), StepStats()
    clock.begin(now=0.0, cpu=0.0)
    clock.scheduled(SHAPE, predicted_s=0.05, now=0.0, wait_s=1.000)
    sample = clock.updated(forward_end=0.08, now=0.1, cpu=0.1, more_work=False, wait_s=1.030)
    assert sample is not None and sample.worker_wait_s == pytest.approx(0.030)
    stats.add(sample)
    assert stats.worker_wait_share() == pytest.approx(0.3)
    assert "worker_wait_ms=30.0/30.0 worker_wait_share=0.300" in stats.summary()


def test_pinned_cores_are_the_single_core_threads(tmp_path: Path) -> None:
    """Worker 7: OpenMP threads 7 and 8 pinned to cores 0 and 1, a poller thread 9 free to run anywhere."""
    for tid in (7, 8, 9):
        (tmp_path / "7" / "task" / str(tid)).mkdir(parents=True)
    masks = {7: {0}, 8: {1}, 9: {0, 1}}
    assert pinned_cores([7], tmp_path, masks.__getitem__) == {0, 1}
    masks[8] = {0, 1}  # one OpenMP thread on core 0 only (VLLM_CPU_OMP_THREADS_BIND=0)
    assert pinned_cores([7], tmp_path, masks.__getitem__) == {0}
    assert pinned_cores([42], tmp_path, masks.__getitem__) == set()  # no such process


def test_pinned_cores_of_this_process() -> None:
    cores = pinned_cores([os.getpid()])
    assert cores <= os.sched_getaffinity(0)


def test_stats_keep_only_the_latest_steps_between_two_log_lines() -> None:
    """A node that plans no prefill for a long time never logs (nor resets) its stats: they keep the latest
    ``MAX_SAMPLES`` steps instead of growing with every step."""
    stats = StepStats()
    shape = step_shape([(1, 10)])
    for i in range(MAX_SAMPLES + 10):
        stats.add(StepSample(shape, 0.01, 0.01, 0.01 + i, 0.0))
    assert len(stats.samples) == MAX_SAMPLES and stats.samples[0].cycle_s == 0.01 + 10
    assert stats.summary().startswith(f"steps={MAX_SAMPLES} ") and not stats.samples
