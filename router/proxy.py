"""One client request from admission to its last byte: admit, route, pick workers, attempt, retry.

Called by ``app.complete`` (router process, one coroutine per request), for requests the lean front
(``front.py``) or aiohttp received; the client side is a ``Downstream`` either way. The jobs an attempt hands
off have their own modules: ``legs.py`` builds and sends the P and D legs per flow, ``relay.py`` streams D's
events to the client, ``resume.py`` continues a stream whose decode worker broke.

- Admission: more than ``server.max_pending`` requests in the router -> 429 with Retry-After. Every decode
  worker saturated -> the request waits for a slot up to ``policy.queue_timeout_s``, then 429; no usable
  decode worker -> it waits for one to come back up to ``policy.unavailable_wait_s``, then 503 (so do
  retries and resumes that find none: ``comeback.py``).
- sglang-bootstrap has no route to D alone, since SGLang's decode servers cannot prefill
  (``RouterConfig.decode_prefills``): the policy sends every request P->D (no usable P -> wait, then 503;
  every P saturated -> wait, then 429), requests of several sequences get 400, and resumes go P->D too.
- KV-aware routing (``[kv_routing]``): the decode worker is placed first, by its cached prefix of the prompt
  against its load (``Balancer.place_decode``), and the policy decides on the tokens it does not hold; the
  prompt is then recorded on the workers it went to.
- Route: the policy says LOCAL (D only, the body forwarded as parsed: the client's, less any transfer fields,
  see ``requests.parse``; reason ``lent``: an idle prefill worker instead of D, ``policy.lend_max_active``) or
  DISAGG (P and D legs per flow, with the router's own transfer fields).
- Retries: until the first byte reached the client, a failed attempt (connect error, 5xx, timeout, broken
  stream) is retried on other workers with exponential backoff and jitter, at most ``retry.max_attempts``.
- After the first byte: a decode worker failure is resumed on another decode worker (``resume.py``).
- P failures: pd-push lets D recompute (its connector times out and prefills locally, per docs/wire-contract.md);
  vllm-standard tries another P, then prefills on D; sglang-bootstrap aborts the D leg and retries the pair.
- Client disconnect (the server cancels the handler): both legs are closed, which makes vLLM abort them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

from router.balancer import Balancer, Placement, Worker
from router.comeback import Choice, Comeback, choose
from router.config import RouterConfig
from router.downstream import Downstream, Reply, json_reply
from router.errors import ApiError, bad_request, overloaded
from router.http1 import Pool
from router.legs import Legs, cancel
from router.metrics import RouterMetrics
from router.policy import Decision, Policy, PolicyInput, Route
from router.relay import ClientGone, ClientStream, relay, write_error
from router.requests import Parsed
from router.resume import resume
from router.streaming import StreamState
from router.trace import Stamps, Tracer
from router.upstream import UpstreamError, post_json

log = logging.getLogger("router.proxy")
# Tells the client which path its request took (local: D only; disagg: P->D), for debugging and the demo.
ROUTE_HEADER = "X-PD-Route"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}  # as vLLM sends


class Proxy:
    """The request handler of one router process (built by ``app.RouterState``); ``pending`` counts the
    requests inside it, which admission bounds."""

    def __init__(
        self,
        cfg: RouterConfig,
        balancer: Balancer,
        policy: Policy,
        upstream: Pool,
        metrics: RouterMetrics,
        tracer: Tracer,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg
        self.balancer = balancer
        self.policy = policy
        self.upstream = upstream
        self.metrics = metrics
        self.tracer = tracer
        self.rng = rng or random.Random()
        self.legs = Legs(cfg, balancer, upstream, metrics, self.rng)
        self.pending = 0

    # ---- admission and routing ---------------------------------------------------------------------------

    async def handle(self, client: Downstream, parsed: Parsed, path: str) -> Reply | None:
        """Serve one parsed request; returns the reply, or None when it went out as a stream to ``client``."""
        if parsed.dropped:
            self.metrics.transfer_fields_dropped.inc()
            # the names only: values are the client's data, which the router never logs
            log.debug("dropped client-supplied transfer fields %s", sorted(parsed.dropped))
        if parsed.fan_out is not None and not self.cfg.decode_prefills():
            # Such requests go to D alone in the other flows; SGLang's D cannot serve them alone, and SGLang
            # pairs all n samples of a prompt with one bootstrap room.
            raise bad_request(
                f"flow sglang-bootstrap serves one sequence per request (one prompt, n = 1); `{parsed.fan_out}`"
                " asks for several: send them as separate requests",
                parsed.fan_out,
            )
        if self.pending >= self.cfg.server.max_pending:
            self.metrics.requests_for(path, "rejected", "overload").inc()
            raise overloaded("the router has too many requests in progress", self.cfg.server.retry_after_s)
        self.pending += 1
        start = time.monotonic()
        try:
            hashes = self.balancer.hashes(parsed.prompt_ids)
            comeback = Comeback(self.cfg.policy.unavailable_wait_s, self.metrics.queued)
            decision, placed = await self._decide(parsed, path, hashes, comeback)
            self.metrics.requests_for(path, decision.route.value, decision.reason).inc()
            self.metrics.lengths(decision.route.value, parsed.prompt_tokens, parsed.max_tokens)
            if hashes:
                self.metrics.placed(
                    decision.route.value, placed.reason, parsed.prompt_tokens, placed.cached_tokens
                )
            async with asyncio.timeout(self.cfg.timeouts.request_s):
                reply = await self._attempts(
                    client, parsed, path, decision.route, start, placed, hashes, comeback
                )
            self.metrics.e2e_for(decision.route.value).observe(time.monotonic() - start)
            return reply
        except asyncio.CancelledError:  # the server cancels the handler when the client disconnects
            self.metrics.client_disconnects.inc()
            raise
        except TimeoutError:
            if not client.started:
                raise ApiError(504, "the request timed out") from None
            with contextlib.suppress(ClientGone):
                await write_error(client, "the request timed out", 504)
            return None
        finally:
            self.pending -= 1

    async def _decide(
        self, parsed: Parsed, path: str, hashes: list[int], comeback: Comeback
    ) -> tuple[Decision, Placement]:
        """The policy's route and the worker placed for it to decode (its first attempt's: a prefill worker
        when the policy lent it one, reason ``lent``; retries place on decode workers). While the policy
        says WAIT, wait for a slot in the pool it names (bounded by queue_timeout_s, then 429); while it says
        REJECT (no usable worker in that pool), wait for one to come back (the request's ``comeback`` bound,
        unavailable_wait_s, then 503): a worker restarting, or taken out by its health checks for a moment,
        costs the request time, not an error."""
        queue_until = time.monotonic() + self.cfg.policy.queue_timeout_s
        retry_after = self.cfg.server.retry_after_s
        self.metrics.queued.inc()
        try:
            while True:
                b = self.balancer
                placed = b.place_decode(
                    self.cfg.policy.decode_max_active, frozenset(), hashes, parsed.prompt_tokens
                )
                decision = self.policy.decide(
                    PolicyInput(
                        parsed.prompt_tokens,
                        b.prefill.load(),
                        b.decode.load(),
                        parsed.fan_out is None,
                        placed.cached_tokens,
                    )
                )
                if decision.reason == "lent":
                    return decision, b.place_lent(hashes)
                if decision.route is Route.LOCAL or decision.route is Route.DISAGG:
                    return decision, placed
                role = _POOL_OF[decision.reason]
                left = (
                    comeback.until() if decision.route is Route.REJECT else queue_until
                ) - time.monotonic()
                if left <= 0:
                    self.metrics.requests_for(path, "rejected", decision.reason).inc()
                    if decision.route is Route.REJECT:
                        raise _unavailable(role, retry_after)
                    raise overloaded(f"every {role} worker is at capacity", retry_after)
                # Woken when a leg ends or a worker changes; re-check at least every 0.5 s (circuit timers).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, 0.5)):
                        await b.pool(role).changed.wait()
        finally:
            self.metrics.queued.dec()

    def _backoff(self, attempt: int) -> float:
        r = self.cfg.retry
        base = min(r.backoff_max_s, r.backoff_base_s * (2**attempt))
        return base * self.rng.uniform(1 - r.jitter, 1 + r.jitter)

    async def _attempts(
        self,
        client: Downstream,
        parsed: Parsed,
        path: str,
        route: Route,
        start: float,
        placed: Placement,
        hashes: list[int],
        comeback: Comeback,
    ) -> Reply | None:
        """``placed``: the first attempt's decode worker; ``hashes``: the prompt's block hashes (KV-aware
        routing; empty when off), by which retries place theirs and the workers that served it are recorded.
        A retry goes to workers that have not failed this request; where a pool it needs has none, it waits
        for one to come back (``comeback``, the request's)."""
        failed: set[Worker] = set()
        last: UpstreamError | None = None
        b = self.balancer
        wants = route is Route.DISAGG

        def pick(first: Placement | None = None) -> Choice:
            return choose(
                b,
                self.cfg.policy.decode_max_active,
                failed,
                wants_prefill=wants,
                needs_prefill=wants and not self.cfg.decode_prefills(),
                hashes=hashes,
                prompt_tokens=parsed.prompt_tokens,
                placed=first,
            )

        for attempt in range(self.cfg.retry.max_attempts):
            if attempt:
                self.metrics.retries.labels("decode").inc()
                await asyncio.sleep(self._backoff(attempt - 1))
            decode, prefill, missing = await comeback.find(b, failed, pick, None if attempt else pick(placed))
            if decode is None or missing:
                break
            stamps = Stamps(start) if prefill is not None else None
            ending = "ok"
            try:
                if parsed.stream:
                    reply = await self._stream(
                        client, parsed, path, decode, prefill, failed, comeback, start, stamps
                    )
                else:
                    reply = await self._unary(parsed, path, decode, prefill, failed, stamps)
                # Recorded once served, not when sent: until then its blocks are being computed, and requests
                # sharing its prefix that arrive meanwhile (a system prompt's first users) would be sent to
                # D alone to compute it all themselves.
                b.record(hashes, decode, prefill)
                return reply
            except UpstreamError as e:
                ending = e.kind
                if e.client_error:
                    return json_reply(e.status, e.body)
                last = e
                log.warning("attempt %d failed: %s", attempt + 1, e)
            except BaseException as e:
                ending = type(e).__name__
                raise
            finally:
                if stamps is not None:
                    self.tracer.end(stamps, ending)
                comeback.saw(failed)
        if last is None:
            raise _unavailable(missing, self.cfg.server.retry_after_s)
        if last.status == 429:
            raise overloaded("upstream workers are overloaded", self.cfg.server.retry_after_s)
        log.error("giving up after %d attempts: %s", self.cfg.retry.max_attempts, last)
        what = "timed out" if last.kind == "timeout" else f"failed ({last.kind})"
        raise ApiError(502, f"upstream workers {what} after {self.cfg.retry.max_attempts} attempts")

    # ---- one attempt -------------------------------------------------------------------------------------

    async def _unary(
        self,
        parsed: Parsed,
        path: str,
        decode: Worker,
        prefill: Worker | None,
        failed: set[Worker],
        stamps: Stamps | None,
    ) -> Reply:
        body, local, p_task = await self.legs.start(
            path, parsed.body, parsed.raw, parsed.prompt_tokens, prefill, failed, {}, stamps
        )
        try:
            with self.balancer.lease(decode):
                try:
                    if stamps is not None:
                        stamps.mark("decode_sent")
                    data = await self.legs.guarded(p_task, post_json(self.upstream, decode, path, body))
                except UpstreamError as e:
                    self.legs.blame(e, decode, prefill, failed)
                    raise
            if stamps is not None:
                stamps.mark("decode_first_event")
                stamps.mark("client_first_byte")
            decode.circuit.record_success()
            route = "local" if local else "disagg"
            return json_reply(200, data, {ROUTE_HEADER: route})
        finally:
            cancel(p_task)

    async def _stream(
        self,
        client: Downstream,
        parsed: Parsed,
        path: str,
        decode: Worker,
        prefill: Worker | None,
        failed: set[Worker],
        comeback: Comeback,
        start: float,
        stamps: Stamps | None,
    ) -> Reply | None:
        """An attempt of a streamed request; commits to the client after the first upstream event."""
        races = prefill is not None and self.legs.races(parsed.body)
        strip = _wants_ids(parsed, decode, races)
        extra = {"return_token_ids": True} if strip else {}
        body, local, p_task = await self.legs.start(
            path, parsed.body, parsed.raw, parsed.prompt_tokens, prefill, failed, extra, stamps
        )
        route = "local" if local else "disagg"
        state = StreamState(need_text=parsed.kind == "chat") if parsed.resumable else None
        stream = ClientStream(client, state, strip, self.metrics, route, self.cfg.timeouts.idle_s)
        try:
            with self.balancer.lease(decode):
                try:
                    resp, lead, first, stitcher = await self.legs.guarded(
                        p_task,
                        self.legs.opening(decode, path, body, p_task, parsed.body, state, strip, stamps),
                    )
                except UpstreamError as e:
                    self.legs.blame(e, decode, prefill, failed)
                    raise
                try:
                    try:
                        await client.start({**_SSE_HEADERS, ROUTE_HEADER: route})
                    except ConnectionError:
                        raise ClientGone from None
                    if stamps is not None:
                        stamps.mark("client_first_byte")
                    self.metrics.ttft_for(route).observe(time.monotonic() - start)
                    err = await relay(stream, resp, decode, first, stitcher, lead, stamps if lead else None)
                finally:
                    resp.close()
            if err is None:
                decode.circuit.record_success()
                return None
            self.legs.fail(decode, err, failed)
            await resume(self.legs, stream, parsed, path, err, failed, comeback)
            return None
        except ClientGone:
            self.metrics.client_disconnects.inc()
            return None if client.started else Reply(499)
        finally:
            cancel(p_task)


#: The pool a WAIT or REJECT decision is about, by its reason.
_POOL_OF = {
    "no_decode": "decode",
    "decode_saturated": "decode",
    "no_prefill": "prefill",
    "prefill_saturated": "prefill",
}


def _unavailable(role: str, retry_after_s: int) -> ApiError:
    return ApiError(503, f"no healthy {role} worker is available", retry_after_s=retry_after_s)


def _wants_ids(parsed: Parsed, decode: Worker, races: bool) -> bool:
    """Ask a vLLM decode worker for token ids (and hide them again) so a resume is token-exact, or, when P's
    answer and D's stream race to carry P's token (``races``), to cut that token out of D's stream."""
    wanted = parsed.resumable or races
    return wanted and decode.cfg.engine == "vllm" and "return_token_ids" not in parsed.body
