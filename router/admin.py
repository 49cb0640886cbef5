"""pd-router's admin API: list, add, remove, drain and switch workers at run time.

Registered by ``app.make_app`` on the router's aiohttp app, behind its authentication middleware (admin keys
only: a client key would let a client choose where requests and KV go). Each handler is bound to the app's
``RouterState``; bodies are read through the app's size limit, parsed strictly, and every mistake is an
OpenAI-style 4xx naming the field.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from router.config import WorkerConfig, secret_hook, worker_errors
from router.downstream import json_reply
from router.errors import ApiError, aiohttp_response, bad_request
from router.requests import decode_json
from router.roles import parse_switch, switch_role

if TYPE_CHECKING:
    from router.app import RouterState

log = logging.getLogger("router.app")
ReadBody = Callable[[web.Request], Awaitable[bytes]]


class _WorkerRef(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    url: str


class _AddWorker(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    worker: WorkerConfig


def _admin_body(raw: bytes, spec: type[Any], dec_hook: Callable[[type, Any], Any] | None = None) -> Any:
    try:
        value = msgspec.convert(decode_json(raw), spec, strict=True, dec_hook=dec_hook)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid admin request: {e}") from None
    if value.role not in ("prefill", "decode"):
        raise bad_request("role must be 'prefill' or 'decode'", "role")
    return value


def _json(obj: Any, status: int = 200) -> web.Response:
    return aiohttp_response(json_reply(status, msgspec.json.encode(obj)))


def add_admin_routes(app: web.Application, state: RouterState, read_body: ReadBody) -> None:
    """Register ``/admin/workers`` (GET list, POST add, DELETE remove), ``/admin/workers/drain`` and
    ``/admin/workers/role`` on ``app``, acting on ``state``."""

    async def list_workers(request: web.Request) -> web.Response:
        return _json({"workers": [w.describe() for w in state.balancer.all_workers()]})

    async def add_worker(request: web.Request) -> web.Response:
        req = _admin_body(await read_body(request), _AddWorker, secret_hook)
        problems = worker_errors(req.worker, req.role, state.cfg.flow)
        if problems:
            raise bad_request("; ".join(problems), "worker")
        try:
            worker = await state.admit(req.worker, req.role)
        except ValueError as e:
            raise ApiError(409, str(e)) from None
        log.info("admin: added %s worker %s", req.role, req.worker.url)
        return _json(worker.describe(), 201)

    async def remove_worker(request: web.Request) -> web.Response:
        ref = _admin_body(await read_body(request), _WorkerRef)
        try:
            worker = await state.retire(ref.url, ref.role)
        except KeyError:
            raise ApiError(404, f"no {ref.role} worker {ref.url}") from None
        log.info("admin: removed %s worker %s (%d legs finish there)", ref.role, ref.url, worker.active)
        return _json(worker.describe())

    async def drain_worker(request: web.Request) -> web.Response:
        """Stop sending new requests to a worker (``{"drain": false}`` in the body undoes it)."""
        body = decode_json(await read_body(request))
        drain = body.pop("drain", True)
        if not isinstance(drain, bool):
            raise bad_request("drain must be true or false", "drain")
        ref = _admin_body(msgspec.json.encode(body), _WorkerRef)
        worker = state.balancer.pool(ref.role).find(ref.url)
        if worker is None:
            raise ApiError(404, f"no {ref.role} worker {ref.url}")
        worker.draining = drain
        state.balancer.pool(ref.role).notify()
        log.info("admin: %s %s worker %s", "draining" if drain else "undrained", ref.role, ref.url)
        return _json(worker.describe())

    async def switch(request: web.Request) -> web.Response:
        """Move a worker to the other pool once its legs of the old role ended (``router.roles``)."""
        req = parse_switch(await read_body(request))
        return _json((await switch_role(state, req)).describe())

    app.router.add_get("/admin/workers", list_workers)
    app.router.add_post("/admin/workers", add_worker)
    app.router.add_delete("/admin/workers", remove_worker)
    app.router.add_post("/admin/workers/drain", drain_worker)
    app.router.add_post("/admin/workers/role", switch)
