"""The Serve deployments of the application: engine replicas (prefill or decode) and the router replica.

Each replica owns one server process, started with ``pd_disagg.servers.ManagedServer``: its own process group
and log file, and ``PR_SET_PDEATHSIG`` so it gets SIGTERM when the replica's process dies, even by SIGKILL
(Serve constructs a replica on its user-code thread, which lives as long as the replica: the death signal
follows that thread). Serve calls ``__del__`` when it stops a replica on purpose, which stops the process
group; ``check_health`` (every ``health_check_period_s``) fails the replica when its process is gone, and
Serve replaces it.

Engine replicas find the router by name in their own application and register themselves through it: a Serve
handle reaches one replica of a deployment, never each, so the router cannot enumerate them. Each health check
registers again (a no-op when the router knows the replica), so a restarted router replica learns them all
within one period. pd-router then routes with its own policy (short prompts straight to D, long ones P->D,
KV-aware placement, failover) over plain HTTP to the engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import ray
from ray import serve

from pd_disagg.engines import router_server
from pd_disagg.ray_serve.app_config import AppArgs
from pd_disagg.ray_serve.engine_command import engine_argv, kv_transfer_config, side_channel_port
from pd_disagg.ray_serve.router_config import worker, write
from pd_disagg.ray_serve.serve_policy import ENGINE_REQUESTS, engine_requests
from pd_disagg.servers import ManagedServer, free_port

log = logging.getLogger("ray.serve")

#: The router deployment's name in the application (engine replicas look it up by it).
ROUTER = "PDRouter"
#: Seconds a registration or an admin call may take before it counts as failed.
CALL_TIMEOUT_S = 30.0
#: Seconds pd-router may take to answer /ready once started.
ROUTER_START_S = 120.0


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


async def _start_healthy(server: ManagedServer, timeout_s: float) -> None:
    """Start ``server`` and wait (off the replica's event loop) until it answers its health check; stop it
    again when it does not, so a replica that fails to construct leaves no process behind."""
    server.start()
    try:
        await asyncio.to_thread(server.wait_healthy, timeout_s)
    except BaseException:
        await asyncio.to_thread(server.stop)
        raise


def _log_dir(args: AppArgs) -> Path:
    return Path(args.log_dir or os.path.join(tempfile.gettempdir(), "pd-ray"))


class EngineReplica:
    """One vLLM server with PDConnector in the role ``role`` on this replica's node, registered with the
    router of this application."""

    # Serve awaits an async constructor; it waits here for the engine's health without blocking the replica.
    async def __init__(self, role: str, args: dict[str, Any]) -> None:  # type: ignore[misc]
        self._role = role
        parsed = msgspec.convert(args, AppArgs)
        context = serve.get_replica_context()
        rank = context.rank.rank
        node_ip = ray.util.get_node_ip_address()
        port = free_port(node_ip)
        side_port = 0
        if role == "prefill":
            side_port = side_channel_port(parsed.side_channel_port_base, rank) or free_port(node_ip)
        url = f"http://{_url_host(node_ip)}:{port}"
        self._server = ManagedServer(
            name=f"{context.app_name}-{role}-{rank}",
            argv=engine_argv(role, parsed, node_ip, port, side_port),
            log_path=_log_dir(parsed) / f"{context.app_name}-{role}-{rank}-{port}.log",
            health_url=f"{url}/health",
            env={"VLLM_NO_USAGE_STATS": "1", **getattr(parsed, role).env},
        )
        kv_config = kv_transfer_config(role, parsed, node_ip, side_port) if role == "prefill" else None
        self._entry = worker(url, kv_config)
        self._metrics_url = f"{url}/metrics"
        self._router = serve.get_deployment_handle(ROUTER, app_name=context.app_name)
        await _start_healthy(self._server, getattr(parsed, role).start_timeout_s)
        await self._register()

    async def _register(self) -> None:
        """Tell the router about this engine (idempotent). A failure is logged, not raised: the router's own
        health is the router replica's business, and the next health check registers again."""

        async def call() -> None:
            await self._router.add_worker.remote(self._role, self._entry)

        try:
            await asyncio.wait_for(call(), CALL_TIMEOUT_S)
        except Exception as e:
            log.warning("could not register %s with %s: %r", self._entry["url"], ROUTER, e)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric (called only with an ``autoscaling_config``): the requests inside
        the engine, which Serve's handles never see (``serve_policy``)."""
        timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(self._metrics_url) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{self._server.name} /metrics: {resp.status}")
            return {ENGINE_REQUESTS: engine_requests(await resp.text())}

    async def check_health(self) -> None:
        """Fail (Serve replaces the replica) when the engine exited; else make sure the router knows it."""
        if not self._server.alive():
            raise RuntimeError(f"{self._server.name} exited; log {self._server.log_path}")
        await self._register()

    async def __del__(self) -> None:
        async def call() -> None:
            await self._router.remove_worker.remote(self._role, self._entry["url"])

        try:
            await asyncio.wait_for(call(), CALL_TIMEOUT_S)
        except Exception as e:
            log.warning("could not deregister %s: %r", self._entry["url"], e)
        await asyncio.to_thread(self._server.stop)


class RouterReplica:
    """pd-router in front of the engine replicas that register with it.

    ``engines``: the prefill and decode deployments (and the autoscaler, when there is one), bound here so that
    one application deploys them all; the engines are reached over HTTP through pd-router, never through these
    handles. pd-router starts with the
    first decode replica (it needs one decode worker); later replicas join through its admin API.
    """

    def __init__(self, args: dict[str, Any], **engines: Any) -> None:
        self._args = msgspec.convert(args, AppArgs)
        self._workers: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
        self._lock = asyncio.Lock()
        self._server: ManagedServer | None = None
        self._admin_url = self._metrics_url = ""
        self._auth: dict[str, str] = {}

    async def add_worker(self, role: str, entry: dict[str, Any]) -> None:
        """Route to the engine ``entry`` describes from now on (idempotent)."""
        async with self._lock:
            if entry in self._workers[role]:
                return
            if self._server is not None:
                await self._admin("POST", {"role": role, "worker": entry})
            elif role == "decode":
                await self._start({**self._workers, role: [*self._workers[role], entry]})
            self._workers[role].append(entry)
            log.info("%s: %s worker %s added", ROUTER, role, entry["url"])

    async def remove_worker(self, role: str, url: str) -> None:
        """Stop routing to the engine at ``url`` (requests already there finish)."""
        async with self._lock:
            kept = [w for w in self._workers[role] if w["url"] != url]
            if len(kept) == len(self._workers[role]):
                return
            if self._server is not None:
                await self._admin("DELETE", {"role": role, "url": url})
            self._workers[role] = kept

    async def metrics_text(self) -> str:
        """pd-router's ``/metrics`` (the autoscaler's input; it may run on another node than this replica)."""
        if self._server is None:
            raise RuntimeError("pd-router has not started: no decode replica registered yet")
        timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(self._metrics_url) as resp:
            if resp.status != 200:
                raise RuntimeError(f"pd-router /metrics: {resp.status}")
            return await resp.text()

    async def check_health(self) -> None:
        if self._server is not None and not self._server.alive():
            raise RuntimeError(f"pd-router exited; log {self._server.log_path}")

    async def __del__(self) -> None:
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)

    async def _start(self, workers: dict[str, list[dict[str, Any]]]) -> None:
        log_dir = _log_dir(self._args)
        name = f"{serve.get_replica_context().app_name}-router"
        path = log_dir / f"{name}-{os.getpid()}.toml"
        cfg = write(path, self._args, workers["prefill"], workers["decode"])
        host = cfg.server.host if cfg.server.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        base = f"http://{_url_host(host)}:{cfg.server.port}"
        server = router_server(path, log_dir=log_dir, port=cfg.server.port, name=name)
        server = dataclasses.replace(server, health_url=f"{base}/ready")
        await _start_healthy(server, ROUTER_START_S)
        keys = sorted(cfg.admin_keys())  # client keys do not open the admin API
        self._auth = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        self._admin_url = f"{base}/admin/workers"
        self._metrics_url = f"{base}/metrics"
        self._server = server

    async def _admin(self, method: str, body: dict[str, Any]) -> None:
        timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.request(method, self._admin_url, json=body, headers=self._auth) as resp,
        ):
            if resp.status >= 400 and not (method == "POST" and resp.status == 409):
                raise RuntimeError(f"pd-router admin {method}: {resp.status} {await resp.text()}")
