"""The shipped examples, used exactly as shipped: pd-router with examples/router.toml in front of a P and a D
started with ``pd-vllm serve MODEL --kv-transfer-config examples/pd_connector.{prefill,decode}.json``.

Proven: a long prompt takes the P->D path and its KV is transferred (exact bytes on both sides, no failure,
no recompute: once, every example transfer failed to connect and D silently recomputed), a short one goes to
D alone; both answer the colocated tokens; no block stays held. The files fix the ports (router 8080, P 8100,
D 8200, P's side channel 7600) and the model path (``.cache/models/tiny-llama``, relative to the repository
root, where ``make test`` builds it), so the servers run from the repository root with those ports.
"""

from __future__ import annotations

import json
import secrets
import tomllib
from pathlib import Path
from typing import Any

import pytest

from integration_tests.conftest import ROOT
from integration_tests.pd_checks import Transfers, blocks_idle, blocks_to_load, metric
from pd_disagg import pd_client
from pd_disagg.engines import base_url, router_server, vllm_server
from tests.polling import wait_until

EXAMPLES = ROOT / "examples"
ROUTER_TOML = EXAMPLES / "router.toml"


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def shipped(start_servers, tiny_model: Path, log_dir: Path) -> dict[str, Any]:
    """The example cluster, started from the files as they are; returns the router config it read."""
    config = tomllib.loads(ROUTER_TOML.read_text())
    model = config["model"]["path"]
    assert (ROOT / model).resolve() == tiny_model.resolve(), "the example's model path is the test model"
    (prefill,), (decode,) = config["prefill"], config["decode"]
    # The connector files name the variable holding the shared key (secret_env); as a user would, export it.
    variable = json.loads((EXAMPLES / "pd_connector.prefill.json").read_text())["kv_connector_extra_config"]
    secret_env = {variable["secret_env"]: secrets.token_hex(32)}
    engines = [
        vllm_server(
            model,
            log_dir=log_dir,
            name=f"example-{role}",
            port=_port(worker["url"]),
            cpu_core=core,
            dtype="float32",
            max_model_len=config["model"]["max_model_len"],
            kv_transfer_config=Path("examples") / f"pd_connector.{role}.json",
            cwd=ROOT,
            env=secret_env,
        )
        for role, worker, core in (("prefill", prefill, 0), ("decode", decode, 1))
    ]
    start_servers(*engines)
    (router,) = start_servers(
        router_server(
            ROUTER_TOML, log_dir=log_dir, port=config["server"]["port"], name="example-router", cwd=ROOT
        )
    )
    return {"config": config, "router": base_url(router), "p": prefill["url"], "d": decode["url"]}


def _complete(url: str, prompt: str) -> tuple[str, dict[str, Any]]:
    """A greedy completion; returns (X-PD-Route, answer)."""
    payload = {"model": ".cache/models/tiny-llama", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    request = pd_client.urllib.request.Request(
        url + "/v1/completions", json.dumps(payload).encode(), {"content-type": "application/json"}
    )
    with pd_client.urllib.request.urlopen(request, timeout=120) as resp:
        return resp.headers.get("X-PD-Route", ""), json.load(resp)


def test_examples_transfer_long_prompts_and_keep_short_ones_on_decode(shipped: dict[str, Any]) -> None:
    config, router, p_url, d_url = shipped["config"], shipped["router"], shipped["p"], shipped["d"]
    threshold = config["policy"]["threshold_tokens"]
    long_prompt = " ".join(f"line {i}: value = compute({i})" for i in range(60))
    _, colocated = _complete(p_url, long_prompt)
    prompt_tokens = colocated["usage"]["prompt_tokens"]
    assert prompt_tokens > threshold
    transfers = Transfers(p_url, d_url)
    route, answer = _complete(router, long_prompt)
    assert route == "disagg"
    assert answer["choices"][0]["text"] == colocated["choices"][0]["text"]
    transfers.check(1, blocks=blocks_to_load(prompt_tokens))
    sent = metric(p_url, "vllm:pd_connector_bytes_sent_total")
    route, answer = _complete(router, "def add(a, b):")
    assert route == "local" and answer["choices"][0]["text"]
    assert metric(p_url, "vllm:pd_connector_bytes_sent_total") == sent
    wait_until(lambda: blocks_idle(p_url) and blocks_idle(d_url), 15, "no block held after the requests")
