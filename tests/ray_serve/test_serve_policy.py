"""Serve's own autoscaling on the engines' requests (``pd_disagg.ray_serve.serve_policy``), without a cluster:
the metric from a vLLM ``/metrics`` text, the formula at its boundaries, and the policy called the way Serve's
controller calls it (Ray's own ``AutoscalingContext``, wrapped by Ray's ``_apply_autoscaling_config`` with
its rounding and delays), from a deployment config Serve's schema accepts."""

from __future__ import annotations

from typing import Any

from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from ray.serve.schema import DeploymentSchema

from pd_disagg.ray_serve.serve_policy import (
    ENGINE_REQUESTS,
    desired_replicas,
    engine_requests,
    engine_requests_policy,
)

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
"""
POLICY = {"policy_function": "pd_disagg.ray_serve.serve_policy:engine_requests_policy"}


def test_the_metric_is_running_plus_waiting() -> None:
    assert engine_requests(VLLM_METRICS) == 5.0
    assert engine_requests("") == 0.0


def test_the_formula_is_serves_queue_length_rule() -> None:
    assert desired_replicas({}, 2.0, current=3) == 3.0  # nothing reported yet: keep the target
    assert desired_replicas({"a": 3.0, "b": 2.0}, 2.0, current=2) == 2.5
    assert desired_replicas({"a": 0.0}, 2.0, current=1) == 0.0


def _context(config: AutoscalingConfig, reported: dict[str, float], current: int) -> AutoscalingContext:
    dep = DeploymentID(name="Decode", app_name="pd")
    replicas = {ReplicaID(unique_id=name, deployment_id=dep): v for name, v in reported.items()}
    return AutoscalingContext(
        deployment_id=dep,
        deployment_name="Decode",
        app_name="pd",
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=list(replicas),
        total_num_requests=0.0,  # what Serve sees: pd-router's requests never pass its handles
        total_queued_requests=0.0,
        aggregated_metrics={ENGINE_REQUESTS: replicas},
        raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=config,
    )


def test_serve_scales_a_deployment_on_its_engines_requests() -> None:
    schema: dict[str, Any] = {
        "name": "Decode",
        "autoscaling_config": {
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 2,
            "upscale_delay_s": 0,
            "downscale_delay_s": 0,
            "policy": POLICY,
        },
    }
    accepted = DeploymentSchema(**schema).autoscaling_config
    assert isinstance(accepted, dict)
    config = AutoscalingConfig(**accepted)
    policy = _apply_autoscaling_config(engine_requests_policy)
    # 4.5 wanted, rounded up; Serve's controller then clips to max_replicas (AutoscalingState.apply_bounds)
    assert policy(_context(config, {"r0": 9.0}, current=1))[0] == 5
    assert policy(_context(config, {"r0": 1.0, "r1": 0.0}, current=2))[0] == 1
    assert policy(_context(config, {"r0": 3.0}, current=1))[0] == 2  # 1.5 rounds up
