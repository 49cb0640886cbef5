"""The autoscaler's own Prometheus metrics (``pd_autoscale_*``), one registry per controller.

The controller sets them after each decision; ``serve`` exposes them at ``/metrics`` on the settings'
``metrics_host:metrics_port`` (an aiohttp site in the controller's event loop) for Prometheus and the shipped
Grafana dashboard (examples/grafana/pd-disagg.json).
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pd_disagg.autoscale.estimate import Estimate
from pd_disagg.autoscale.policy import Decision, Replicas


class AutoscaleMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.desired = Gauge(
            "pd_autoscale_desired_replicas", "Replicas the last decision set", ["role"], registry=r
        )
        self.current = Gauge(
            "pd_autoscale_current_replicas",
            "Replicas the orchestrator reported, by state (running, starting)",
            ["role", "state"],
            registry=r,
        )
        self.planned = Gauge(
            "pd_autoscale_planned_replicas", "Replicas the planner wanted (-1: unknown)", ["role"], registry=r
        )
        self.decisions = Counter(
            "pd_autoscale_decisions",
            "Decisions by role and reason (policy.Reason)",
            ["role", "reason"],
            registry=r,
        )
        self.arrival_rate = Gauge(
            "pd_autoscale_arrival_rate",
            "Requests/s over the window, by route (all, disagg)",
            ["route"],
            registry=r,
        )
        self.attainment = Gauge(
            "pd_autoscale_slo_attainment",
            "Share within the SLO over the window (ttft: first tokens, itl: token gaps; -1: too few samples)",
            ["slo"],
            registry=r,
        )
        self.start_time = Gauge(
            "pd_autoscale_replica_start_seconds",
            "Measured: from a scale-up's order until that many replicas ran (the plan's look-ahead)",
            ["role"],
            registry=r,
        )
        self.errors = Counter(
            "pd_autoscale_errors",
            "Intervals that failed, by step (scrape, replicas, scale, tick)",
            ["step"],
            registry=r,
        )

    def record(self, estimate: Estimate) -> None:
        self.arrival_rate.labels("all").set(estimate.arrival_rate)
        self.arrival_rate.labels("disagg").set(estimate.disagg_rate)
        for slo, value in (("ttft", estimate.ttft_attainment), ("itl", estimate.itl_attainment)):
            self.attainment.labels(slo).set(-1 if value is None else value)

    def started(self, measured_s: dict[str, float]) -> None:
        for role, seconds in measured_s.items():
            self.start_time.labels(role).set(seconds)

    def decided(self, decision: Decision, planned: int | None, replicas: Replicas) -> None:
        role = decision.role
        self.desired.labels(role).set(decision.target)
        self.planned.labels(role).set(-1 if planned is None else planned)
        self.current.labels(role, "running").set(replicas.running)
        self.current.labels(role, "starting").set(replicas.starting)
        self.decisions.labels(role, decision.reason.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve(metrics: AutoscaleMetrics, host: str, port: int) -> web.AppRunner:
    """Serve ``/metrics`` on ``host:port``; the caller cleans the returned runner up."""

    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
