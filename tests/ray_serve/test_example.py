"""examples/ray_serve.yaml agrees with itself and builds: its arguments pass the application's checks, the
router's block size and context are the engines', and ``build_app`` makes the application graph from it
(without a cluster: binding deploys nothing). integration_tests/test_ray_serve.py runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from ray.serve.deployment import Application

from pd_disagg.ray_serve.app import ENGINE_DEPLOYMENTS, build_app
from pd_disagg.ray_serve.app_config import parse_args
from pd_disagg.ray_serve.deployments import ROUTER
from pd_disagg.ray_serve.router_config import STAND_IN_DECODE, router_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "ray_serve.yaml"


def _app() -> dict[str, Any]:
    app: dict[str, Any] = yaml.safe_load(CONFIG.read_text())["applications"][0]
    return app


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_example_arguments_pass_and_the_router_matches_the_engines() -> None:
    args = parse_args(_app()["args"], cwd=str(ROOT))
    cfg = router_config(args, [], [STAND_IN_DECODE])
    for role in ("prefill", "decode"):
        vllm_args = getattr(args, role).vllm_args
        assert int(_flag(vllm_args, "--block-size")) == cfg.kv_routing.block_size
        assert int(_flag(vllm_args, "--max-model-len")) == cfg.model.max_model_len
    assert cfg.flow == "pd-push" and cfg.model.path == ".cache/models/tiny-llama"
    connector = _app()["args"]["connector"]
    assert "secret" not in connector and connector["secret_env"], (
        "the example ships a variable's name, no key"
    )


def test_example_names_every_deployment_the_builder_makes() -> None:
    named = {d["name"] for d in _app()["deployments"]}
    assert named == {ROUTER, *ENGINE_DEPLOYMENTS.values()}


def test_example_builds_the_application_graph() -> None:
    assert isinstance(build_app(_app()["args"]), Application)
