"""The target verdict both adapters log: when it is said, and what it says (a fixed cost law; no engine)."""

from __future__ import annotations

import logging

import pytest

from scheduler_plugins.budget import StepPlan
from scheduler_plugins.cost_model import CostModel, step_shape
from scheduler_plugins.verdict import VERDICT_INTERVAL_S, TargetJudge, feasibility

LAW = (0.020, 1e-3, 1e-3, 0.0)  # 20 ms + 1 ms per prefill token + 1 ms per decode
PLAN = StepPlan(decodes=4, decode_context=400, prefill_cached=0, max_step_tokens=512)  # + 16 tokens: 40 ms


def _measured(steps: int) -> CostModel:
    model = CostModel(LAW)
    shape = step_shape([(16, 0), *[(1, 100)] * 4])
    for _ in range(steps):
        model.observe(shape, 0.040)
    return model


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_the_verdict_waits_for_measured_steps_and_a_decode(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.verdict")
    judge = TargetJudge("SLO scheduler", logger, after_steps=8)
    with caplog.at_level(logging.INFO, logger="test.verdict"):
        judge.judge(_measured(7), PLAN, 16, limit_s=0.085, target_ms=100, now=0.0)  # too few steps
        lone = StepPlan(decodes=0, decode_context=0, prefill_cached=0, max_step_tokens=512)
        judge.judge(_measured(8), lone, 16, limit_s=0.085, target_ms=100, now=0.0)  # no decode to judge for
        assert _said(caplog) == []
        judge.judge(_measured(8), PLAN, 16, limit_s=0.085, target_ms=100, now=0.0)
    assert _said(caplog) == [
        "SLO scheduler target holds: itl_target_ms=100; 4 decodes + a 16-token chunk predicted 40.0 ms "
        "<= limit 85.0 ms"
    ]


def test_a_target_the_cheapest_step_exceeds_is_called_out_once_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("test.verdict")
    judge, model = TargetJudge("SLOScheduler", logger, after_steps=8), _measured(8)
    with caplog.at_level(logging.INFO, logger="test.verdict"):
        judge.judge(model, PLAN, 16, limit_s=0.034, target_ms=40, now=0.0)
        judge.judge(model, PLAN, 16, limit_s=0.034, target_ms=40, now=1.0)  # the same verdict: not again
        judge.judge(model, PLAN, 16, limit_s=0.085, target_ms=40, now=2.0)  # flipped too soon: not yet
        judge.judge(model, PLAN, 16, limit_s=0.085, target_ms=40, now=2.0 + VERDICT_INTERVAL_S)
        judge.judge(model, PLAN, 16, limit_s=0.034, target_ms=30, now=33.0)  # a new target: at once
    said = _said(caplog)
    assert len(said) == 3, said
    assert said[0].startswith(
        "SLOScheduler cannot hold itl_target_ms=40 here: 4 decodes + the minimum 16-token"
    )
    assert "predicted at 40.0 ms > limit 34.0 ms" in said[0]
    assert said[1].startswith("SLOScheduler target holds: itl_target_ms=40;")
    assert said[2].startswith("SLOScheduler cannot hold itl_target_ms=30 here")
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO, logging.WARNING]


def test_feasibility_at_the_limit() -> None:
    assert feasibility(0.085, 0.085).holds
    over = feasibility(0.0851, 0.085)
    assert not over.holds and over.floor_ms == pytest.approx(85.1) and over.limit_ms == pytest.approx(85.0)
