"""Whether the ITL target can be held at all, said in the server log by either adapter.

Called in the engine's scheduler process, on steps that plan a prefill chunk (``scheduler_plugins.vllm``'s
``_plan_step``, ``scheduler_plugins.sglang``'s ``chunked_prefill_size``). Why: an SLO scheduler has to hold
its target on the hardware it gets, or say that it cannot; with no verdict, a target the decodes plus the
smallest chunk already exceed looks like a scheduler bug. The verdict compares the cheapest step that still
moves a prefill on (the running decodes plus the minimum chunk), as the cost model predicts it, with the
limit (headroom x target).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from scheduler_plugins.budget import StepPlan, explain
from scheduler_plugins.cost_model import CostModel

#: Near the limit the verdict flips as decodes come and go: a change for the same target is logged at most
#: this often.
VERDICT_INTERVAL_S = 30.0


@dataclass(frozen=True)
class Feasibility:
    """Whether the target can be held: the cheapest step that still moves a prefill on, as predicted."""

    holds: bool
    floor_ms: float  # predicted ms of the step with the decodes and the minimum chunk
    limit_ms: float  # what the step may take (headroom x target)


def feasibility(predicted_floor_s: float, limit_s: float) -> Feasibility:
    return Feasibility(predicted_floor_s <= limit_s, predicted_floor_s * 1e3, limit_s * 1e3)


class TargetJudge:
    """One scheduler's verdicts: the first once the model has measured ``after_steps`` steps (prefill steps
    among them), then whenever the effective target changes, and when the verdict changes (at most every
    ``VERDICT_INTERVAL_S``). Only steps with a decode in them are judged: the target is about the decodes'
    gaps, and a "holds" from a prefill alone would stand for the whole interval."""

    def __init__(self, name: str, logger: logging.Logger | logging.LoggerAdapter, after_steps: int) -> None:
        self._name, self._logger, self._after = name, logger, after_steps
        self.verdict: Feasibility | None = None  # the last one logged, for the target in _target_ms
        self._target_ms = 0.0
        self._at = 0.0

    def judge(
        self, model: CostModel, plan: StepPlan, min_chunk: int, limit_s: float, target_ms: float, now: float
    ) -> None:
        """Log the verdict for this step if it is due (``now``: ``time.monotonic()``)."""
        if not plan.decodes or model.observations < self._after or not model.prefill_observations:
            return
        verdict = feasibility(model.predict(plan.shape(min_chunk)), limit_s)
        last = self.verdict
        if (
            last is not None
            and target_ms == self._target_ms
            and (verdict.holds == last.holds or now - self._at < VERDICT_INTERVAL_S)
        ):
            return
        self.verdict, self._target_ms, self._at = verdict, target_ms, now
        step = (self._name, target_ms, plan.decodes, min_chunk, verdict.floor_ms, verdict.limit_ms)
        if verdict.holds:
            self._logger.info(
                "%s target holds: itl_target_ms=%g; %d decodes + a %d-token chunk predicted %.1f ms <= limit "
                "%.1f ms",
                *step,
            )
            return
        self._logger.warning(
            "%s cannot hold itl_target_ms=%g here: %d decodes + the minimum %d-token chunk are predicted at "
            "%.1f ms > limit %.1f ms (%s); every step still prefills at least %d tokens (no starvation), "
            "so gaps will exceed the target: raise the target, run fewer streams, or give the engine (and "
            "the API server) more cores",
            *step,
            explain(model, plan, min_chunk, limit_s),
            min_chunk,
        )
