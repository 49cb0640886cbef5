"""The Ray Serve adapter of the autoscaler without a cluster: replica counts from the dashboard's answer, and
``RayServeScaler`` against a stand-in dashboard on real HTTP whose scale endpoint validates the body with Ray's
own request model (``ray.serve.schema.ScaleDeploymentRequest``) on Ray's path; the application graph with the
``Autoscaler`` deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from ray.serve.deployment import Application
from ray.serve.schema import ScaleDeploymentRequest, ServeApplicationSchema

from pd_disagg.autoscale.policy import Replicas
from pd_disagg.ray_serve.app import ENGINE_DEPLOYMENTS, build_app
from pd_disagg.ray_serve.app_config import AppConfigError, parse_args
from pd_disagg.ray_serve.autoscaler import (
    RayServeScaler,
    default_dashboard_url,
    replicas_from_details,
    scale_path,
)
from planner.profile import DecodePoint, Profile

ROOT = Path(__file__).resolve().parents[2]


def _details(states: dict[str, list[str]], targets: dict[str, int]) -> dict[str, Any]:
    deployments = {
        name: {"target_num_replicas": targets[name], "replicas": [{"state": s} for s in replica_states]}
        for name, replica_states in states.items()
    }
    return {"applications": {"pd": {"deployments": deployments}}}


def test_replicas_count_running_and_starting_apart_and_leaving_ones_not_at_all() -> None:
    details = _details(
        {"Prefill": ["RUNNING"], "Decode": ["RUNNING", "STARTING", "STOPPING"]}, {"Prefill": 1, "Decode": 2}
    )
    assert replicas_from_details(details, "pd", ENGINE_DEPLOYMENTS) == {
        "prefill": Replicas(running=1, starting=0, target=1),
        "decode": Replicas(running=1, starting=1, target=2),
    }
    with pytest.raises(KeyError, match="'other' is not deployed"):
        replicas_from_details(details, "other", ENGINE_DEPLOYMENTS)
    with pytest.raises(KeyError, match="'Decode' not in"):
        replicas_from_details(_details({"Prefill": []}, {"Prefill": 1}), "pd", ENGINE_DEPLOYMENTS)


def test_the_dashboard_defaults_to_the_heads_address() -> None:
    assert default_dashboard_url("10.0.0.5:6379") == "http://10.0.0.5:8265"


async def test_scaler_reads_and_sets_counts_through_the_dashboard_api() -> None:
    targets = {"Prefill": 1, "Decode": 1}
    external = {"enabled": True}

    async def applications(_: web.Request) -> web.Response:
        states = {name: ["RUNNING"] * n for name, n in targets.items()}
        return web.json_response(_details(states, targets))

    async def scale(request: web.Request) -> web.Response:
        assert request.match_info["app"] == "pd"
        body = ScaleDeploymentRequest(**await request.json())  # Ray's own check of the body
        if not external["enabled"]:
            return web.json_response({"error": "external_scaler_enabled=false"}, status=412)
        targets[request.match_info["name"]] = body.target_num_replicas
        return web.json_response({"message": "Scaling request received."})

    app = web.Application()
    app.router.add_get("/api/serve/applications/", applications)
    app.router.add_post("/api/v1/applications/{app}/deployments/{name}/scale", scale)
    assert scale_path("pd", "Decode") == "/api/v1/applications/pd/deployments/Decode/scale"
    server = TestServer(app)
    await server.start_server()
    try:
        scaler = RayServeScaler(str(server.make_url("")), "pd", ENGINE_DEPLOYMENTS)
        await scaler.scale("decode", 2)
        assert targets == {"Prefill": 1, "Decode": 2}
        assert (await scaler.replicas())["decode"] == Replicas(running=2, starting=0, target=2)
        external["enabled"] = False
        with pytest.raises(RuntimeError, match=r"412.*external_scaler_enabled: true"):
            await scaler.scale("decode", 1)
    finally:
        await server.close()


def _profile(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    path.write_bytes(msgspec.json.encode(Profile(2000.0, 0.1, [DecodePoint(1, 0.04), DecodePoint(16, 0.06)])))
    return path


def _example() -> dict[str, Any]:
    app: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "ray_serve.yaml").read_text())["applications"][
        0
    ]
    return app


def test_autoscale_arguments_resolve_the_profile_and_refuse_bad_settings(tmp_path: Path) -> None:
    _profile(tmp_path)
    raw = {
        **_example()["args"],
        "autoscale": {"profile": "profile.json", "ttft_slo_s": 1.0, "tpot_slo_s": 0.1},
    }
    args = parse_args(raw, cwd=str(tmp_path))
    assert args.autoscale is not None and args.autoscale.profile == str(tmp_path / "profile.json")
    bad = {**raw, "autoscale": {**raw["autoscale"], "max_decode": 0, "profile": "nowhere.json"}}
    with pytest.raises(AppConfigError) as error:
        parse_args(bad, cwd=str(tmp_path))
    assert (
        "autoscale: " in str(error.value)
        and "max_decode" in str(error.value)
        and "nowhere" in str(error.value)
    )


def test_with_autoscale_the_graph_has_the_autoscaler_and_serve_accepts_external_scaling(
    tmp_path: Path,
) -> None:
    example = _example()
    args = {
        **example["args"],
        "autoscale": {"profile": str(_profile(tmp_path)), "ttft_slo_s": 1, "tpot_slo_s": 0.1},
    }
    assert isinstance(build_app(args), Application)
    # The application config the docs give: Serve's own schema takes it (and would refuse its autoscaling).
    config = {**example, "args": args, "external_scaler_enabled": True}
    config["deployments"] = [*example["deployments"], {"name": "Autoscaler", "num_replicas": 1}]
    assert ServeApplicationSchema(**config).external_scaler_enabled
    with_ray_autoscaling = {
        **config,
        "deployments": [{"name": "Decode", "autoscaling_config": {"max_replicas": 2}}],
    }
    with pytest.raises(ValueError, match="external_scaler_enabled"):
        ServeApplicationSchema(**with_ray_autoscaling)
