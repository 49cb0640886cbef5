"""The shipped example files agree with each other and parse as the connector and the router read them."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from pd_connector.vllm.config import PDConnectorConfig
from router.config import load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _extra(role: str) -> dict[str, object]:
    config = json.loads((EXAMPLES / f"pd_connector.{role}.json").read_text())
    extra: dict[str, object] = config["kv_connector_extra_config"]
    return extra


def test_router_bootstrap_is_the_prefill_side_channel_and_secrets_match() -> None:
    """A mismatch once made every example P->D request fall back to recompute, with only D's log saying so."""
    router = tomllib.loads((EXAMPLES / "router.toml").read_text())
    prefill, decode = _extra("prefill"), _extra("decode")
    assert int(router["prefill"][0]["bootstrap"].rsplit(":", 1)[1]) == prefill["side_channel_port"]
    assert prefill["secret"] == decode["secret"] and prefill["transport"] == decode["transport"]
    load_config(EXAMPLES / "router.toml")


def test_connector_examples_pass_protected_mode() -> None:
    """Both bind beyond loopback (other hosts must reach them), so both need the shared secret."""
    for role in ("prefill", "decode"):
        config = PDConnectorConfig.from_extra_config(_extra(role))
        assert config.secret
        policy = config.peer_policy()
        policy.check_listener("side channel", config.side_channel_host)
        assert policy.refusal("10.1.2.3:7600") is None, "with a secret, D may dial a P on another host"
    prefill = PDConnectorConfig.from_extra_config(_extra("prefill"))
    assert not prefill.side_channel_addr.startswith("0.0.0.0"), "P returns an address D can dial"
