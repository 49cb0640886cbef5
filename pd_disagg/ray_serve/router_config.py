"""pd-router's configuration in the Ray Serve application: the user's router tables, the model, and the engine
replicas registered so far.

``deployments.RouterReplica`` writes it when the first decode replica registers (pd-router needs one decode
worker to start) and adds later replicas through pd-router's admin API with ``worker``'s entries;
``app.build_app`` checks the user's tables beforehand with a stand-in decode worker (``STAND_IN_DECODE``), so a
bad router setting fails ``serve run`` instead of the router replica. Validation is pd-router's own
(``router.config.parse_config``).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pd_connector.vllm.config import PDConnectorConfig
from pd_disagg.engines import write_router_config
from pd_disagg.ray_serve.app_config import AppArgs
from router.config import RouterConfig, parse_config

#: A decode entry that only lets ``router_config`` validate the user's tables before any replica exists.
STAND_IN_DECODE: dict[str, Any] = {"url": "http://127.0.0.1:1", "engine": "vllm"}


def worker(url: str, kv_transfer_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """pd-router's worker entry (``[[prefill]]``/``[[decode]]``, or the admin API's ``worker``) of the vLLM
    server at ``url``; a prefill server's ``kv_transfer_config`` gives the side channel the router hands D."""
    entry: dict[str, Any] = {"url": url, "engine": "vllm"}
    if kv_transfer_config is not None:
        settings = PDConnectorConfig.from_extra_config(kv_transfer_config["kv_connector_extra_config"])
        entry["bootstrap"] = settings.side_channel_addr
    return entry


def _tables(args: AppArgs) -> tuple[str, dict[str, dict[str, Any]]]:
    """(flow, the TOML tables): the user's, with ``model.path`` the served name and the tokenizer the model's
    own directory unless the user named one."""
    tables = {name: dict(value) for name, value in args.router.items() if name != "flow"}
    model = tables.setdefault("model", {})
    model["path"] = args.served_name()
    model["tokenizer"] = model.get("tokenizer") or args.model
    return str(args.router.get("flow", "pd-push")), tables


def router_config(
    args: AppArgs, prefill: Sequence[dict[str, Any]], decode: Sequence[dict[str, Any]]
) -> RouterConfig:
    """The validated configuration (raises ``router.config.ConfigError``)."""
    flow, tables = _tables(args)
    return parse_config({"flow": flow, **tables, "prefill": list(prefill), "decode": list(decode)})


def write(
    path: Path, args: AppArgs, prefill: Sequence[dict[str, Any]], decode: Sequence[dict[str, Any]]
) -> RouterConfig:
    """Validate, then write pd-router's TOML file at ``path``; returns what pd-router will read.

    The engine replicas join through pd-router's admin API, which client keys do not open: when the user set
    client keys and no admin key, the file gets an admin key of its own, known only to the router replica."""
    flow, tables = _tables(args)
    server = tables.setdefault("server", {})
    keyed = server.get("api_keys") or server.get("api_keys_env")
    if keyed and not (server.get("admin_keys") or server.get("admin_keys_env")):
        server["admin_keys"] = [secrets.token_urlsafe(32)]
    cfg = parse_config({"flow": flow, **tables, "prefill": list(prefill), "decode": list(decode)})
    write_router_config(path, flow=flow, sections=tables, prefill=prefill, decode=decode)
    return cfg
