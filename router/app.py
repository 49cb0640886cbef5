"""The router's aiohttp application: OpenAI endpoints, health/readiness, metrics, and the admin API
(``admin.py``) mounted on it.

Built by ``make_app(cfg)`` and served by ``cli.py`` behind the lean front (``front.py``), which answers most
completion requests itself through ``complete``; unit tests serve it the same way. One
``RouterState`` per app holds the pools, the policy, the upstream connections and the metrics, so several routers
can live in one process. Every error a client can cause is answered with an OpenAI-style 4xx body; request
bodies and Authorization headers are never logged.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import aiohttp
import msgspec
import zmq.asyncio
from aiohttp import web

from router.admin import add_admin_routes
from router.balancer import Balancer, Worker
from router.config import RouterConfig, WorkerConfig
from router.downstream import Downstream, Reply, json_reply
from router.errors import ApiError, aiohttp_response
from router.health import HealthChecker
from router.http1 import Pool
from router.kv_events import KvEventsSubscriber, WorkerEvents
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.policy import make_policy
from router.proxy import Proxy
from router.requests import Kind, check_media_type, parse
from router.tokenize import PromptTokenizer
from router.trace import Tracer
from router.upstream import check_health

log = logging.getLogger("router.app")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Answer = TypeVar("Answer")
#: The endpoints ``complete`` serves, by path.
COMPLETIONS: Mapping[str, Kind] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class RouterState:
    """Everything one router instance owns (created at app start-up, closed at clean-up)."""

    def __init__(self, cfg: RouterConfig, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.rng = rng or random.Random()
        self.tokenizer = PromptTokenizer(cfg.tokenizer_dir())
        self.metrics = RouterMetrics()
        self.balancer = Balancer(cfg.circuit, self.rng, kv=cfg.kv_routing)
        for role, workers in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            for w in workers:
                self.balancer.add(w, role).healthy = False  # until the first check passes
        self.metrics.watch_workers(self.balancer.all_workers)
        if self.balancer.prefixes is not None:
            self.metrics.watch_prefixes(self.balancer.prefixes)
        self.keys = cfg.client_keys()
        self.admin_keys = cfg.admin_keys()
        self.created = int(time.time())
        self.upstream: Pool | None = None  # request legs and health checks
        self.checker: HealthChecker | None = None
        self.proxy: Proxy | None = None
        self.tracer: Tracer | None = None
        self.kv_events: dict[Worker, KvEventsSubscriber] = {}  # by worker, for those that publish events
        self._zmq: zmq.asyncio.Context | None = None

    async def start(self) -> None:
        self.upstream = Pool(self.cfg.timeouts.connect_s)
        policy = make_policy(self.cfg.policy, self.cfg.decode_prefills())
        self.tracer = Tracer(self.metrics.registry, self.cfg.server.trace_path)
        self.proxy = Proxy(
            self.cfg, self.balancer, policy, self.upstream, self.metrics, self.tracer, self.rng
        )
        self.checker = HealthChecker(self.cfg.health, self._check, self.balancer.all_workers, self._changed)
        await self.initial_check(self.balancer.all_workers())
        self.checker.start()
        for w in self.balancer.all_workers():
            self.follow_kv_events(w)

    def follow_kv_events(self, worker: Worker) -> None:
        """KV-aware routing: follow ``worker``'s KV events when it publishes them (configured or added through
        the admin API; ``unfollow_kv_events`` when it is removed)."""
        index = self.balancer.prefixes
        if index is None or not worker.cfg.kv_events or worker in self.kv_events:
            return
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        count = functools.partial(self._count_kv_events, worker.url)
        events = WorkerEvents(index, worker, worker.cfg.engine)
        sub = KvEventsSubscriber(worker.cfg.kv_events, events, count, self._zmq)
        sub.start()
        self.kv_events[worker] = sub

    async def unfollow_kv_events(self, worker: Worker) -> None:
        """Stop following a removed worker's events, and drop what they put in the index."""
        sub = self.kv_events.pop(worker, None)
        if sub is not None:
            await sub.stop()
        if self.balancer.prefixes is not None:
            self.balancer.prefixes.forget(worker)

    async def admit(self, cfg: WorkerConfig, role: str) -> Worker:
        """Add a worker at run time (admin API, role switch): one health check sets its state, and its KV
        events are followed. Raises ``ValueError`` when the URL is already a worker of ``role``."""
        worker = self.balancer.add(cfg, role)
        worker.healthy = False
        await self.initial_check([worker])
        self.follow_kv_events(worker)
        return worker

    async def retire(self, url: str, role: str) -> Worker:
        """Remove a worker at run time (its legs in flight finish) and stop following its KV events. Raises
        ``KeyError`` when ``url`` is no worker of ``role``."""
        worker = self.balancer.remove(url, role)
        await self.unfollow_kv_events(worker)
        return worker

    def _count_kv_events(self, url: str, result: str) -> None:
        self.metrics.kv_events.labels(url, result).inc()

    async def initial_check(self, workers: list[Worker]) -> None:
        """One check per worker that sets its state directly (no streak needed at start-up or when added)."""
        results = await asyncio.gather(*(self._check(w.url) for w in workers))
        for w, ok in zip(workers, results, strict=True):
            w.healthy = ok
            if not w.healthy:
                log.warning("%s worker %s is not healthy yet", w.role, w.url)
            self._changed(w)

    async def _check(self, url: str) -> bool:
        assert self.upstream is not None
        return await check_health(self.upstream, url, self.cfg.health.timeout_s)

    def _changed(self, worker: Any) -> None:
        self.balancer.decode.notify()
        self.balancer.prefill.notify()

    async def close(self) -> None:
        if self.checker is not None:
            await self.checker.stop()
        for sub in self.kv_events.values():
            await sub.stop()
        if self._zmq is not None:
            self._zmq.term()
        if self.upstream is not None:
            self.upstream.close()
        if self.tracer is not None:
            self.tracer.close()


STATE = web.AppKey("state", RouterState)
_PUBLIC = frozenset({"/health", "/ready", "/metrics"})


def _auth_error(state: RouterState, path: str, authorization: str) -> ApiError | None:
    """Why the request may not reach ``path`` (None: it may). The admin API takes admin keys only: a client
    key would let a client choose where requests and KV go (a worker it adds), which no client may."""
    if path in _PUBLIC:
        return None
    token = authorization[7:] if authorization.startswith("Bearer ") else ""
    if path.startswith("/admin"):
        if state.admin_keys:
            return (
                None if _matches(token, state.admin_keys) else ApiError(401, "invalid or missing admin key")
            )
        if state.keys:
            return ApiError(403, "the admin API takes admin keys only, and none is set (server.admin_keys)")
        return None  # no authentication configured at all
    if not state.keys or _matches(token, state.keys):
        return None
    return ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)")


def _matches(token: str, keys: frozenset[str]) -> bool:
    return any(hmac.compare_digest(token.encode(), k.encode()) for k in keys)


def too_large(state: RouterState) -> ApiError:
    return ApiError(413, f"request body exceeds {state.cfg.server.max_body_bytes} bytes")


async def answered(
    state: RouterState, method: str, path: str, authorization: str, run: Callable[[], Awaitable[Answer]]
) -> Answer | Reply:
    """Check the API key, then ``run`` the endpoint; any error becomes its OpenAI-style reply.

    Called by both servers (aiohttp's middleware and the lean front) so that they answer alike.
    """
    try:
        if (refused := _auth_error(state, path, authorization)) is not None:
            raise refused
        return await run()
    except ApiError as e:
        return e.reply()
    except Exception:
        log.exception("unexpected error on %s %s", method, path)
        return ApiError(500, "internal router error").reply()


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    endpoint = (
        request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    )

    async def run() -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            raise too_large(state) from None
        except web.HTTPException as e:  # aiohttp's own 404/405 for unknown paths and methods
            raise ApiError(e.status, e.reason) from None

    answer = await answered(
        state, request.method, request.path, request.headers.get("Authorization", ""), run
    )
    resp = aiohttp_response(answer) if isinstance(answer, Reply) else answer
    state.metrics.responses_for(endpoint, str(resp.status)).inc()
    return resp


async def _read_body(request: web.Request) -> bytes:
    limit = request.app[STATE].cfg.server.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    return await request.read()


async def complete(
    state: RouterState, path: str, content_type: str, raw: bytes, client: Downstream
) -> Reply | None:
    """Serve a completion or chat request (``path`` in ``COMPLETIONS``) whose body is ``raw``.

    ``content_type`` is the request's Content-Type header ("" when absent). Returns the reply, or None when
    the response went out as a stream to ``client``. Raises ``ApiError``.
    """
    assert state.proxy is not None
    cfg = state.cfg
    check_media_type(content_type)
    parsed = await parse(
        COMPLETIONS[path],
        raw,
        state.tokenizer,
        cfg.served_names(),
        cfg.model.max_model_len,
        cfg.policy.threshold_tokens,
    )
    return await state.proxy.handle(client, parsed, path)


class _AiohttpStream:
    """``Downstream`` over an aiohttp request: the SSE response is an aiohttp ``StreamResponse``."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    @property
    def chunked(self) -> bool:
        return self.response is not None and self.response.headers.get("Transfer-Encoding") == "chunked"

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._request.transport

    async def start(self, headers: Mapping[str, str]) -> None:
        response = web.StreamResponse(headers=headers)
        try:
            await response.prepare(self._request)
        except aiohttp.ClientConnectionResetError as e:
            raise ConnectionError(str(e)) from None
        self.response = response

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write(data)
        except aiohttp.ClientConnectionResetError as e:
            raise ConnectionError(str(e)) from None


def _completions_handler(path: str) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        client = _AiohttpStream(request)
        content_type = request.headers.get("Content-Type", "")
        reply = await complete(state, path, content_type, await _read_body(request), client)
        if reply is not None:
            return aiohttp_response(reply)
        assert client.response is not None
        return client.response

    return handle


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cfg = state.cfg
    data = [
        {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "pd-router",
            "root": cfg.model.path,
            "parent": None,
            "max_model_len": cfg.model.max_model_len,
        }
        for name in cfg.served_names()
    ]
    return aiohttp_response(json_reply(200, msgspec.json.encode({"object": "list", "data": data})))


async def _health(request: web.Request) -> web.Response:
    """Liveness: the router process answers."""
    return web.Response(text="ok")


async def _ready(request: web.Request) -> web.Response:
    """Readiness: at least one decode worker can take requests."""
    if request.app[STATE].balancer.decode.usable():
        return web.Response(text="ready")
    return web.Response(status=503, text="no usable decode worker")


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def make_app(cfg: RouterConfig, rng: random.Random | None = None) -> web.Application:
    """The router as an aiohttp app (start-up runs a first health round and starts the checker)."""
    app = web.Application(middlewares=[_errors], client_max_size=cfg.server.max_body_bytes)
    state = RouterState(cfg, rng)
    app[STATE] = state

    async def lifecycle(app: web.Application) -> Any:
        await state.start()
        yield
        await state.close()

    app.cleanup_ctx.append(lifecycle)
    for path in COMPLETIONS:
        app.router.add_post(path, _completions_handler(path))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    add_admin_routes(app, state, _read_body)
    return app
