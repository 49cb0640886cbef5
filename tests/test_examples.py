"""The shipped example files agree with each other and parse as the connector and the router read them."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from pd_connector.settings import SettingError
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
    assert prefill["secret_env"] == decode["secret_env"] and prefill["transport"] == decode["transport"]
    load_config(EXAMPLES / "router.toml")


def test_connector_examples_pass_protected_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both bind beyond loopback (other hosts must reach them), so both need the shared secret, which they
    read from the environment: a key written in a shipped file would be everyone's key."""
    for role in ("prefill", "decode"):
        extra = _extra(role)
        assert "secret" not in extra, "the examples ship no key"
        monkeypatch.delenv(str(extra["secret_env"]), raising=False)
        with pytest.raises(SettingError, match="unset or empty"):
            PDConnectorConfig.from_extra_config(extra)
        monkeypatch.setenv(str(extra["secret_env"]), "a key of the user's own")
        config = PDConnectorConfig.from_extra_config(extra)
        assert config.secret == "a key of the user's own"
        policy = config.peer_policy()
        policy.check_listener("side channel", config.side_channel_host)
        assert policy.refusal("10.1.2.3:7600") is None, "with a secret, D may dial a P on another host"
    prefill = PDConnectorConfig.from_extra_config(_extra("prefill"))
    assert not prefill.side_channel_addr.startswith("0.0.0.0"), "P returns an address D can dial"
