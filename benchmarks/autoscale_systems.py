"""The three systems ``benchmarks.autoscale`` compares, as Serve configs of the one application
(``pd_disagg.ray_serve.app:build_app``), built from examples/ray_serve.yaml:

- ``static``: 1P1D, fixed.
- ``ray``: Serve's own autoscaling, each engine deployment on its own (no P/D coupling, as Serve's P/D builder
  does): Serve's queue-length rule on the requests inside the engines
  (``pd_disagg.ray_serve.serve_policy``), Serve's default ``target_ongoing_requests`` (2) and upscale delay
  (30 s), and the same down-scale delay as ours' hold (Serve's default, 600 s, would never scale down within
  a phase).
- ``ours``: the planner-driven ``Autoscaler`` (docs/ray.md) through Serve's external-scaler API.

Every system runs the same engines (every flag of the example but the CPU binding: ``nobind`` and one OpenMP
thread each, so that the operating system spreads up to three engines over the host's cores, where the
example pins P to core 0 and D to core 1 and a second replica of a role would share its core), at most two
replicas per role, and at most three engines at once: each engine replica takes one unit of the custom
resource ``engine``, of which the cluster has three (``ENGINE_SLOTS``). pd-router and the autoscaler take a
share of ``front``, which only the head has. No Ray here: ``tests/test_bench_autoscale.py`` checks that
every config passes Serve's schema and the application's own checks.
"""

from __future__ import annotations

import copy
import secrets
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ray_serve.yaml"
SYSTEMS = ("static", "ray", "ours")
#: Engines alive at once, at most: the cluster's units of the ``engine`` resource (one per replica).
ENGINE_SLOTS = 3
MAX_PER_ROLE = 2
#: The engines' environment besides the example's: no core binding, one thread (see the module docstring).
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
#: Serve's own defaults for the ``ray`` system (ray.serve.config.AutoscalingConfig, Ray 2.60).
RAY_TARGET_ONGOING_REQUESTS = 2.0
RAY_UPSCALE_DELAY_S = 30.0
ENGINE_POLICY = {"policy_function": "pd_disagg.ray_serve.serve_policy:engine_requests_policy"}


class Knobs:
    """What a run decides for every system: paths, ports, SLOs and the shared timing."""

    def __init__(
        self,
        *,
        model: Path,
        profile: Path,
        log_dir: Path,
        router_port: int,
        dashboard_port: int,
        ttft_slo_s: float,
        tpot_slo_s: float,
        hold_s: float,
        replica_start_s: float,
    ) -> None:
        self.model, self.profile, self.log_dir = model, profile, log_dir
        self.router_port, self.dashboard_port = router_port, dashboard_port
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.hold_s, self.replica_start_s = hold_s, replica_start_s


def _engine_options(num_replicas: int | None) -> dict[str, Any]:
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": 0, "resources": {"engine": 1}}}
    if num_replicas is not None:
        options["num_replicas"] = num_replicas
    return options


def serve_config(system: str, knobs: Knobs) -> dict[str, Any]:
    """The whole Serve config (``serve deploy`` input) of ``system``."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; one of {SYSTEMS}")
    config: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    app = config["applications"][0]
    args = app["args"]
    args["model"] = str(knobs.model)
    args["served_model_name"] = "model"
    args["side_channel_port_base"] = 0
    args["log_dir"] = str(knobs.log_dir)
    # The example names the variable holding the connector's key (secret_env): a fresh key for P and D.
    key = {args["connector"]["secret_env"]: secrets.token_hex(32)}
    for role in ("prefill", "decode"):
        args[role]["env"] = {**args[role]["env"], **ENGINE_ENV, **key}
    args["router"]["server"] = {"host": "127.0.0.1", "port": knobs.router_port}
    front = {"num_cpus": 0, "resources": {"front": 0.01}}
    deployments: list[dict[str, Any]] = [{"name": "PDRouter", "num_replicas": 1, "ray_actor_options": front}]
    if system == "static":
        deployments += [{"name": name, **_engine_options(1)} for name in ("Prefill", "Decode")]
    elif system == "ray":
        autoscaling = {
            "min_replicas": 1,
            "initial_replicas": 1,
            "max_replicas": MAX_PER_ROLE,
            "target_ongoing_requests": RAY_TARGET_ONGOING_REQUESTS,
            "upscale_delay_s": RAY_UPSCALE_DELAY_S,
            "downscale_delay_s": knobs.hold_s,
            "policy": ENGINE_POLICY,
        }
        deployments += [
            {"name": name, **_engine_options(None), "autoscaling_config": copy.deepcopy(autoscaling)}
            for name in ("Prefill", "Decode")
        ]
    else:
        app["external_scaler_enabled"] = True
        args["dashboard_url"] = f"http://127.0.0.1:{knobs.dashboard_port}"
        args["autoscale"] = {
            "profile": str(knobs.profile),
            "ttft_slo_s": knobs.ttft_slo_s,
            "tpot_slo_s": knobs.tpot_slo_s,
            "interval_s": 5.0,
            "window_s": 30.0,
            "replica_start_s": knobs.replica_start_s,
            "scale_down_hold_s": knobs.hold_s,
            "cooldown_s": 20.0,
            "max_prefill": MAX_PER_ROLE,
            "max_decode": MAX_PER_ROLE,
        }
        deployments += [{"name": name, **_engine_options(1)} for name in ("Prefill", "Decode")]
        deployments.append({"name": "Autoscaler", "num_replicas": 1, "ray_actor_options": front})
    app["deployments"] = deployments
    return config
