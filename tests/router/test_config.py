"""Config parsing: defaults, every error names its key, secrets never show in repr."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import ConfigError, Secret, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


def _minimal(**extra):
    return {"model": {"path": "m"}, "decode": [{"url": "http://127.0.0.1:1"}], **extra}


def test_minimal_config_gets_documented_defaults() -> None:
    cfg = parse_config(_minimal())
    assert cfg.flow == "pd-push"
    assert cfg.policy.threshold_tokens == 256
    assert cfg.server.port == 8080
    assert (cfg.server.keepalive_s, cfg.server.shutdown_timeout_s) == (75.0, 60.0)
    assert cfg.served_names() == ("m",)
    assert cfg.tokenizer_dir() == "m"


def _sglang(**extra):
    table = _minimal(
        flow="sglang-bootstrap",
        policy={"threshold_tokens": 0},
        prefill=[{"url": "http://p:1", "engine": "sglang", "bootstrap_port": 8998}],
        decode=[{"url": "http://d:1", "engine": "sglang"}],
    )
    return {**table, **extra}


def test_sglang_bootstrap_config_sends_everything_through_prefill() -> None:
    cfg = parse_config(_sglang())
    assert not cfg.decode_prefills() and parse_config(_minimal()).decode_prefills()


def test_example_config_is_valid() -> None:
    cfg = load_config(ROOT / "examples" / "router.toml")
    assert cfg.prefill and cfg.decode


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        (_minimal(polcy={}), "polcy"),
        (_minimal(policy={"threshold_tokens": "10"}), "policy.threshold_tokens"),
        ({"model": {"path": "m"}, "decode": []}, "at least one decode worker"),
        (_minimal(timeouts={"idle_s": 0}), "timeouts.idle_s"),
        (_minimal(prefill=[{"url": "http://p:1"}]), "prefill[0].bootstrap"),
        (_minimal(decode=[{"url": "tcp://x"}]), "decode[0].url"),
        (_minimal(decode=[{"url": "http://d:1/v1"}]), "decode[0].url: must be the server's base"),
        (_minimal(decode=[{"url": "http://a:1"}, {"url": "http://a:1"}]), "duplicate"),
        (_minimal(flow="nixl"), "flow"),
        (_minimal(retry={"jitter": 2.0}), "retry.jitter"),
        (_minimal(policy={"unavailable_wait_s": -1}), "policy.unavailable_wait_s: must be >= 0"),
        (_minimal(server={"keepalive_s": 0}), "server.keepalive_s"),
        (_minimal(server={"shutdown_timeout_s": -1}), "server.shutdown_timeout_s"),
        (_minimal(flow="sglang-bootstrap", prefill=[{"url": "http://p:1"}]), "bootstrap_port"),
        (_sglang(policy={}), 'policy.threshold_tokens: must be 0 with flow = "sglang-bootstrap"'),
        (_sglang(policy={"threshold_tokens": 1}), "SGLang's decode servers cannot prefill alone"),
        (_sglang(prefill=[]), 'prefill: flow = "sglang-bootstrap" needs at least one prefill worker'),
    ],
)
def test_invalid_configs_name_the_key(table, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(table)
    assert needle in str(info.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\npath=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_secrets_do_not_show(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUTER_KEYS", "k-env-1, k-env-2")
    cfg = parse_config(
        _minimal(
            server={"api_keys": ["k-file-secret"], "api_keys_env": "ROUTER_KEYS"},
            decode=[{"url": "http://d:1", "api_key": "upstream-secret"}],
        )
    )
    assert isinstance(cfg.decode[0].api_key, Secret)
    text = repr(cfg)
    assert "k-file-secret" not in text and "upstream-secret" not in text
    assert cfg.client_keys() == {"k-file-secret", "k-env-1", "k-env-2"}


def test_cli_refuses_a_bad_config_with_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    bad = tmp_path / "r.toml"
    bad.write_text('[model]\npath = "m"\n[[decode]]\nurl = "http://d:1"\n[policy]\nthreshold_tokens = -1\n')
    assert main(["--config", str(bad)]) == 2
    assert "policy.threshold_tokens" in capsys.readouterr().err
