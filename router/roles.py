"""Switching a worker's role at run time (admin API ``POST /admin/workers/role``), without restarting it.

An engine that serves both roles (vLLM with ``kv_role`` ``kv_both``: one connector is both P and D) can move
between the prefill and the decode pool as the traffic mix shifts. The router cannot ask an engine which roles
it serves, so the worker's configuration says so (``roles = ["prefill", "decode"]``); a switch to a role not
listed is refused. Runs in the router process, on its event loop, called by the admin endpoint in ``app.py``:

1. the worker is drained (``draining``: no new leg of its old role is sent to it);
2. the switch waits, at most the drain timeout, until its legs of the old role ended (``active`` reaches 0;
   each ended leg wakes the pool's ``changed`` event). Past the timeout it is undrained (back as it was) and
   the switch refused with 409: the worker kept its old role and lost nothing;
3. it leaves the old pool and joins the other one as a new ``Worker`` (fresh load counts and circuit; one
   health check, as an added worker gets; its KV events followed again).

A request placed on the worker before the drain but whose leg was not yet sent (vllm-standard: D is sent once
P answered) still goes to it under its old role after the switch; a ``kv_both`` engine serves it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Protocol

import msgspec

from router.balancer import Balancer, Pool, Worker
from router.config import Role, RouterConfig, WorkerConfig, worker_errors
from router.errors import ApiError, bad_request
from router.metrics import RouterMetrics
from router.requests import decode_json

log = logging.getLogger("router.roles")


class RoleSwitch(msgspec.Struct, forbid_unknown_fields=True):
    """The admin request: move the worker at ``url`` to ``role``.

    ``bootstrap`` / ``bootstrap_port``: its prefill settings (``[[prefill]]`` table) when it becomes a prefill
    worker and its configuration lacks them; ``drain_timeout_s``: this switch's drain timeout (default
    ``timeouts.role_drain_s``, at most ``timeouts.request_s``: no leg outlives that).
    """

    url: str
    role: Role
    bootstrap: str | None = None
    bootstrap_port: int | None = None
    drain_timeout_s: float | None = None


class Switchable(Protocol):
    """What a switch needs of the router (``app.RouterState``)."""

    cfg: RouterConfig
    balancer: Balancer
    metrics: RouterMetrics

    async def admit(self, cfg: WorkerConfig, role: str) -> Worker: ...

    async def retire(self, url: str, role: str) -> Worker: ...


def parse_switch(raw: bytes) -> RoleSwitch:
    """The request body as a ``RoleSwitch`` (400 naming what is wrong)."""
    try:
        return msgspec.convert(decode_json(raw), RoleSwitch, strict=True)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid role switch: {e}") from None


async def switch_role(router: Switchable, req: RoleSwitch) -> Worker:
    """Drain the worker of its old role, then move it to ``req.role``; returns the worker in its new pool.

    Raises ``ApiError``: 400 bad settings, 404 unknown worker, 409 when it cannot serve the role, is already
    switching, was removed meanwhile, or its legs did not end within the drain timeout.
    """
    balancer, cfg = router.balancer, router.cfg
    timeout = _drain_timeout(cfg, req.drain_timeout_s)
    old_role = "decode" if req.role == "prefill" else "prefill"
    if balancer.pool(req.role).find(req.url) is not None:
        raise ApiError(409, f"{req.url} is already a {req.role} worker")
    pool = balancer.pool(old_role)
    worker = pool.find(req.url)
    if worker is None:
        raise ApiError(404, f"no worker {req.url}")
    if req.role not in worker.cfg.roles:
        raise ApiError(
            409,
            f"{req.url} serves {list(worker.cfg.roles or (old_role,))} only: list both roles in its `roles`"
            " setting when the engine can serve both (vLLM kv_role kv_both)",
        )
    if worker.switching_to:
        raise ApiError(409, f"{req.url} is already switching to {worker.switching_to}")
    new_cfg = msgspec.structs.replace(
        worker.cfg,
        bootstrap=worker.cfg.bootstrap if req.bootstrap is None else req.bootstrap,
        bootstrap_port=worker.cfg.bootstrap_port if req.bootstrap_port is None else req.bootstrap_port,
    )
    if problems := worker_errors(new_cfg, req.role, cfg.flow):
        raise bad_request(f"as a {req.role} worker: " + "; ".join(problems), "bootstrap")
    started = time.monotonic()
    was_draining = worker.draining
    worker.draining, worker.switching_to = True, req.role
    pool.notify()
    try:
        drained = await _drain(worker, pool, timeout)
    finally:
        worker.switching_to = ""
    still_there = pool.find(req.url) is worker
    if not drained or not still_there or balancer.pool(req.role).find(req.url) is not None:
        if still_there:  # back as it was
            worker.draining = was_draining
            pool.notify()
        if not drained:
            router.metrics.role_switches.labels(req.role, "timeout").inc()
            raise ApiError(
                409,
                f"{req.url} still had {worker.active} {old_role} legs after {timeout:g} s; it stays a"
                f" {old_role} worker (retry, or raise drain_timeout_s)",
            )
        raise ApiError(409, f"{req.url} was removed, or added as a {req.role} worker, while it drained")
    router.metrics.role_drain.observe(time.monotonic() - started)
    await router.retire(req.url, old_role)
    moved = await router.admit(new_cfg, req.role)
    router.metrics.role_switches.labels(req.role, "switched").inc()
    log.info("admin: switched %s from %s to %s", req.url, old_role, req.role)
    return moved


def _drain_timeout(cfg: RouterConfig, asked: float | None) -> float:
    if asked is None:
        return cfg.timeouts.role_drain_s
    if not (math.isfinite(asked) and 0 < asked <= cfg.timeouts.request_s):
        raise bad_request(
            f"drain_timeout_s must be > 0 and <= timeouts.request_s ({cfg.timeouts.request_s:g}), got {asked}",
            "drain_timeout_s",
        )
    return asked


async def _drain(worker: Worker, pool: Pool, timeout_s: float) -> bool:
    """Wait until ``worker`` has no leg in flight (True), at most ``timeout_s`` (False). Each ended leg
    notifies its worker's pool (``Balancer.lease``), which wakes this wait to look again."""
    try:
        async with asyncio.timeout(timeout_s):
            while worker.active:
                await pool.changed.wait()
    except TimeoutError:
        return False
    return True
