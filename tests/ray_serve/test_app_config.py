"""The Ray Serve application's arguments and what a replica builds from them, without Ray: argument checks,
the per-replica kv-transfer-config and command line, and pd-router's configuration."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pd_connector.vllm.config import PDConnectorConfig
from pd_disagg.autoscale.settings import AutoscaleSettings
from pd_disagg.ray_serve.app_config import AppArgs, AppConfigError, RoleArgs, parse_args
from pd_disagg.ray_serve.engine_command import engine_argv, kv_transfer_config, side_channel_port
from pd_disagg.ray_serve.router_config import STAND_IN_DECODE, router_config, worker, write
from router.config import ConfigError, load_config


def _raw(**over: Any) -> dict[str, Any]:
    return {"model": "models/tiny", "connector": {"transport": "tcp", "secret": "s3cret"}, **over}


def _args(**over: Any) -> AppArgs:
    return parse_args(_raw(**over), cwd="/srv")


def test_model_resolves_against_the_working_directory_and_clients_keep_its_name() -> None:
    args = _args()
    assert args.model == "/srv/models/tiny" and args.served_name() == "models/tiny"
    assert _args(served_model_name="tiny").served_name() == "tiny"
    assert parse_args(_raw(model="/abs/m"), cwd="/srv").model == "/abs/m"


@pytest.mark.parametrize(
    ("over", "names"),
    [
        ({"modle": "x"}, "modle"),
        ({"connector": {"transport": "tcp"}}, "connector.secret"),
        ({"connector": {"secret": "s", "side_channel_port": 7600}}, "side_channel_port"),
        ({"connector": {"secret": "s", "data_host": "0.0.0.0"}}, "data_host"),
        ({"connector": {"secret": "s", "lease_s": "60"}}, "lease_s"),
        ({"connector": {"secret": "s", "leese_s": 60}}, "leese_s"),
        ({"side_channel_port_base": 70000}, "side_channel_port_base"),
        ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
        ({"decode": {"start_timeout_s": 0}}, "decode.start_timeout_s"),
        ({"router": {"decode": [{"url": "http://h:1"}]}}, "router.decode"),
        ({"router": {"model": {"path": "x"}}}, "router.model.path"),
    ],
)
def test_bad_arguments_are_refused_naming_the_key(over: dict[str, Any], names: str) -> None:
    with pytest.raises(AppConfigError, match=names):
        _args(**over)


def test_a_secret_from_the_engines_environment_is_passed_on_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``secret_env`` satisfies the secret check without the variable in this process (the engines' hosts
    hold it); each engine reads it (here the variable is set for that step only); set with ``secret`` too,
    it is refused."""
    monkeypatch.delenv("PD_TEST_SECRET", raising=False)
    args = _args(connector={"transport": "tcp", "secret_env": "PD_TEST_SECRET"})
    extra = kv_transfer_config("prefill", args, "10.0.0.7", 7701)["kv_connector_extra_config"]
    assert extra["secret_env"] == "PD_TEST_SECRET" and "secret" not in extra
    monkeypatch.setenv("PD_TEST_SECRET", "from-the-host")
    assert PDConnectorConfig.from_extra_config(extra).secret == "from-the-host"
    with pytest.raises(AppConfigError, match="secret_env: set together with secret"):
        _args(connector={"secret": "s", "secret_env": "PD_TEST_SECRET"})


def test_insecure_connector_needs_no_secret_when_the_user_says_so() -> None:
    assert _args(connector={"allow_insecure": True}).connector == {"allow_insecure": True}


def test_prefill_replica_listens_and_advertises_on_its_node_with_the_users_settings() -> None:
    config = kv_transfer_config("prefill", _args(), "10.0.0.7", 7701)
    assert config["kv_connector"] == "PDConnector" and config["kv_role"] == "kv_producer"
    settings = PDConnectorConfig.from_extra_config(config["kv_connector_extra_config"])
    assert settings.side_channel_addr == "10.0.0.7:7701" and settings.data_host == "10.0.0.7"
    assert settings.secret == "s3cret" and settings.transport == "tcp"


def test_decode_replica_receives_on_its_node_and_opens_no_side_channel() -> None:
    config = kv_transfer_config("decode", _args(), "10.0.0.8", 0)
    assert config["kv_role"] == "kv_consumer" and config["kv_load_failure_policy"] == "recompute"
    failing = kv_transfer_config("decode", _args(kv_load_failure_policy="fail"), "10.0.0.8", 0)
    assert failing["kv_load_failure_policy"] == "fail"
    assert "kv_load_failure_policy" not in kv_transfer_config("prefill", _args(), "10.0.0.7", 7701)
    extra = config["kv_connector_extra_config"]
    assert extra["data_host"] == "10.0.0.8" and "side_channel_port" not in extra


def test_side_channel_port_per_replica_rank() -> None:
    assert [side_channel_port(7700, r) for r in range(3)] == [7700, 7701, 7702]
    assert side_channel_port(0, 5) == 0, "0: the replica picks a free port"
    with pytest.raises(ValueError, match="65535"):
        side_channel_port(65535, 1)


def test_engine_command_serves_the_model_on_the_node_with_the_users_flags_last() -> None:
    args = _args(prefill={"vllm_args": ["--dtype", "float32"]})
    argv = engine_argv("prefill", args, "10.0.0.7", 8101, 7700)
    assert argv[1:5] == ["-m", "pd_disagg.vllm_launcher", "serve", "/srv/models/tiny"]
    flags = dict(zip(argv[5:-2:2], argv[6:-2:2], strict=True))
    assert flags["--host"] == "10.0.0.7" and flags["--port"] == "8101"
    assert flags["--served-model-name"] == "models/tiny"
    assert json.loads(flags["--kv-transfer-config"]) == kv_transfer_config("prefill", args, "10.0.0.7", 7700)
    assert argv[-2:] == ["--dtype", "float32"]


def test_router_workers_give_d_the_prefills_advertised_side_channel() -> None:
    kv = kv_transfer_config("prefill", _args(), "10.0.0.7", 7700)
    assert worker("http://10.0.0.7:8101", kv) == {
        "url": "http://10.0.0.7:8101",
        "engine": "vllm",
        "bootstrap": "10.0.0.7:7700",
    }
    assert worker("http://10.0.0.8:8201") == {"url": "http://10.0.0.8:8201", "engine": "vllm"}


def test_router_config_keeps_the_users_tables_and_names_the_served_model() -> None:
    args = _args(router={"flow": "pd-push", "policy": {"threshold_tokens": 64}, "server": {"port": 8300}})
    cfg = router_config(args, [], [STAND_IN_DECODE])
    assert cfg.model.path == "models/tiny" and cfg.tokenizer_dir() == "/srv/models/tiny"
    assert cfg.policy.threshold_tokens == 64 and cfg.server.port == 8300 and cfg.flow == "pd-push"
    named = _args(router={"model": {"tokenizer": "/tok"}})
    assert router_config(named, [], [STAND_IN_DECODE]).tokenizer_dir() == "/tok"


def test_bad_router_tables_are_pd_routers_own_errors() -> None:
    with pytest.raises(ConfigError, match="threshold_tokens"):
        router_config(_args(router={"policy": {"threshold_tokens": -1}}), [], [STAND_IN_DECODE])
    with pytest.raises(ConfigError, match="decode"):
        router_config(_args(), [], [])


def test_written_config_is_what_pd_router_loads(tmp_path: Path) -> None:
    args = _args(router={"policy": {"threshold_tokens": 64}})
    prefill = [worker("http://10.0.0.7:8101", kv_transfer_config("prefill", args, "10.0.0.7", 7700))]
    decode = [worker("http://10.0.0.8:8201")]
    path = tmp_path / "router.toml"
    assert write(path, args, prefill, decode) == load_config(path)
    assert tomllib.loads(path.read_text())["prefill"][0]["bootstrap"] == "10.0.0.7:7700"


def _ray_serve_rows() -> list[tuple[set[str], str]]:
    """docs/configuration.md ``## Ray Serve``: each table row's argument names and its default cell."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    section = text.split("\n## Ray Serve\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = line.split(" | ")
            rows.append((set(re.findall(r"`([a-z_.]+)`", cells[0])), cells[1]))
    return rows


def test_every_argument_is_documented_in_configuration_md() -> None:
    """docs/configuration.md ``## Ray Serve`` names each argument (a role's as ``prefill.X``, ``decode.X``, an
    autoscaler setting as ``autoscale.X``), and each autoscaler setting with its default."""
    rows = _ray_serve_rows()
    documented = {name for names, _ in rows for name in names}
    nested: dict[str, type[msgspec.Struct]] = {
        "prefill": RoleArgs,
        "decode": RoleArgs,
        "autoscale": AutoscaleSettings,
    }
    expected = {f.name for f in msgspec.structs.fields(AppArgs)} - nested.keys()
    expected |= {f"{key}.{f.name}" for key, cls in nested.items() for f in msgspec.structs.fields(cls)}
    assert documented == expected
    for f in msgspec.structs.fields(AutoscaleSettings):
        [cell] = [default for names, default in rows if f"autoscale.{f.name}" in names]
        shown = re.findall(r"`([^`]*)`", cell)
        if f.default is msgspec.NODEFAULT:
            assert "required" in cell, f.name
        else:
            assert shown and json.loads(shown[0]) == f.default, (f.name, cell)


def test_a_router_with_client_keys_gets_an_admin_key_of_its_own(tmp_path: Path) -> None:
    """Replicas register through the admin API, which client keys do not open: with client keys and no admin
    key, the written file carries a generated admin key (not a client one); without client keys, none."""
    keyed = write(
        tmp_path / "k.toml", _args(router={"server": {"api_keys": ["sk-c"]}}), [], [STAND_IN_DECODE]
    )
    assert keyed.client_keys() == {"sk-c"}
    [admin] = keyed.admin_keys()
    assert admin != "sk-c" and len(admin) >= 32
    assert load_config(tmp_path / "k.toml").admin_keys() == {admin}
    open_router = write(tmp_path / "o.toml", _args(), [], [STAND_IN_DECODE])
    assert open_router.admin_keys() == frozenset() and open_router.client_keys() == frozenset()
    mine = _args(router={"server": {"api_keys": ["sk-c"], "admin_keys": ["sk-a"]}})
    assert write(tmp_path / "m.toml", mine, [], [STAND_IN_DECODE]).admin_keys() == {"sk-a"}
