"""Planner-driven autoscaling of the P and D pools (docs/ray.md, "Autoscaling"), engine- and orchestrator-agnostic.

One job per module: ``settings`` (the settings, one definition), ``prom`` (Prometheus text and histogram
arithmetic), ``estimate`` (the live workload over a window of pd-router's metrics), ``plan`` (replicas per role
from ``planner.tails``), ``policy`` (the decision: hysteresis, bounds, cooldown, starting replicas),
``startup`` (replica start time as measured), ``metrics`` (``pd_autoscale_*``) and ``controller`` (the loop).
An orchestrator adapter supplies the metrics text and a ``controller.Scaler``; Ray Serve's is
``pd_disagg.ray_serve.autoscaler``.
"""
