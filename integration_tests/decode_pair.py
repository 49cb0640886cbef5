"""Two tiny-model vLLM servers (one per core, float32) behind a pd-router process that keeps every request
on them (decode workers only): the cluster ``test_router.py`` and ``test_chat_resume.py`` each start for
their module (both SIGKILL one of the servers, so they cannot share one). Nothing here starts a server: the
module's ``start_servers`` fixture does, and stops them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from pd_disagg.engines import base_url, router_server, vllm_server
from pd_disagg.servers import ManagedServer, free_port


def decode_servers(tiny_model: Path, log_dir: Path, prefix: str, max_model_len: int) -> list[ManagedServer]:
    """The two servers, named ``{prefix}-d0`` and ``{prefix}-d1``, on cores 0 and 1."""
    return [
        vllm_server(
            tiny_model,
            log_dir=log_dir,
            name=f"{prefix}-d{i}",
            cpu_core=i,
            dtype="float32",
            max_model_len=max_model_len,
        )
        for i in range(2)
    ]


def decode_router(
    config: Path,
    tiny_model: Path,
    log_dir: Path,
    max_model_len: int,
    decodes: list[ManagedServer],
    policy: Mapping[str, int] | None = None,
) -> ManagedServer:
    """pd-router (flow pd-push) with ``decodes`` as its decode workers, its TOML written to ``config``: fast
    health checks (0.5 s) and retries (10 ms back-off), so a killed server leaves the pool at once."""
    lines = [
        'flow = "pd-push"',
        "[model]",
        f"path = {json.dumps(str(tiny_model))}",  # JSON strings and numbers are valid TOML values
        f"max_model_len = {max_model_len}",
    ]
    if policy:
        lines += ["[policy]", *(f"{key} = {value}" for key, value in policy.items())]
    lines += ["[health]", "interval_s = 0.5", "[retry]", "backoff_base_s = 0.01"]
    for d in decodes:
        lines += ["[[decode]]", f"url = {json.dumps(base_url(d))}"]
    config.write_text("\n".join(lines) + "\n")
    return router_server(config, log_dir=log_dir, port=free_port())
