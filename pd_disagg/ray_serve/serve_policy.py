"""Serve's own autoscaling for the engine deployments, fed with the requests inside each engine.

Serve's request-based policy counts the requests that pass through its handles and proxy; in this application
pd-router sends them to the engines over plain HTTP, so Serve would see none and never scale. Each engine
replica therefore reports the requests its vLLM server holds (running and waiting, from its ``/metrics``) as
the custom autoscaling metric ``ENGINE_REQUESTS`` (``EngineReplica.record_autoscaling_stats``, which Serve
calls only for a deployment with an ``autoscaling_config``), and ``engine_requests_policy`` is Serve's default
formula on that sum: desired replicas = requests / ``target_ongoing_requests``. Serve applies its own
smoothing factors, ``min_replicas``/``max_replicas`` and up/down delays around it (custom policies are wrapped
by ``ray.serve.autoscaling_policy._apply_autoscaling_config``), each deployment on its own: P and D scale
independently, with no P/D coupling, as Serve's own P/D builder does. ``benchmarks.autoscale`` compares it
with the planner-driven autoscaler (docs/ray.md). Use it in a deployment's options:

    autoscaling_config:
      min_replicas: 1
      max_replicas: 2
      target_ongoing_requests: 2
      policy: {policy_function: "pd_disagg.ray_serve.serve_policy:engine_requests_policy"}
"""

from __future__ import annotations

from typing import Any

from pd_disagg.autoscale.prom import Scrape

#: The custom metric's name: requests inside one engine (vLLM's running plus waiting).
ENGINE_REQUESTS = "engine_requests"


def engine_requests(metrics_text: str) -> float:
    """Requests running and waiting in the vLLM server whose ``/metrics`` text this is."""
    scrape = Scrape.parse(metrics_text)
    return scrape.total("vllm:num_requests_running") + scrape.total("vllm:num_requests_waiting")


def desired_replicas(per_replica: dict[Any, float], target_ongoing_requests: float, current: int) -> float:
    """Serve's queue-length formula (``_core_replica_queue_length_policy``) on the engines' requests:
    ``current`` when no replica reported yet, else their sum over the target per replica."""
    if not per_replica:
        return float(current)
    return sum(per_replica.values()) / target_ongoing_requests


def engine_requests_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Serve's custom policy entry point (``ctx``: ``ray.serve.config.AutoscalingContext``)."""
    reported = (ctx.aggregated_metrics or {}).get(ENGINE_REQUESTS, {})
    target = ctx.config.get_target_ongoing_requests()
    return desired_replicas(dict(reported), target, ctx.target_num_replicas), {}
