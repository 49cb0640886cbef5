"""One client request from admission to its last byte: route, pick workers, send legs, retry, resume.

Called by ``app.complete`` (router process, one coroutine per request), for requests the lean front
(``front.py``) or aiohttp received; the client side is a ``Downstream`` either way.

- Admission: more than ``server.max_pending`` requests in the router -> 429 with Retry-After. Every decode
  worker saturated -> the request waits for a slot up to ``policy.queue_timeout_s``, then 429; no usable
  decode worker -> 503.
- sglang-bootstrap has no route to D alone, since SGLang's decode servers cannot prefill
  (``RouterConfig.decode_prefills``): the policy sends every request P->D (no usable P -> 503, every P
  saturated -> wait, then 429), requests of several sequences get 400, and resumes go P->D too.
- Route: the policy says LOCAL (D only, the body forwarded as parsed: the client's, less any transfer fields,
  see ``requests.parse``) or DISAGG (P and D legs per flow, with the router's own transfer fields).
- Retries: until the first byte reached the client, a failed attempt (connect error, 5xx, timeout, broken
  stream) is retried on other workers with exponential backoff and jitter, at most ``retry.max_attempts``.
- After the first byte: a decode worker failure is resumed on another decode worker (``streaming.py``).
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
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from router.balancer import Balancer, Worker
from router.config import RouterConfig
from router.downstream import Downstream, Reply, http_chunk, json_reply
from router.errors import ApiError, bad_request, overloaded
from router.http1 import HttpError, Pool, Response
from router.metrics import EventSeries, RouterMetrics
from router.policy import Decision, Policy, PolicyInput, Route
from router.requests import Parsed
from router.streaming import DONE, Stitcher, StreamState, continuation, strip_token_ids
from router.upstream import (
    UpstreamError,
    bootstrap_room,
    decode_body,
    open_stream,
    post_json,
    prefill_body,
    read_event,
    returned_params,
    transfer_id,
    wrap_error,
)

log = logging.getLogger("router.proxy")
# Tells the client which path its request took (local: D only; disagg: P->D), for debugging and the demo.
ROUTE_HEADER = "X-PD-Route"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}  # as vLLM sends


class _PrefillFailed(UpstreamError):
    """The P leg failed and the D leg cannot go on without it (sglang-bootstrap); D is not to blame."""


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


class Proxy:
    def __init__(
        self,
        cfg: RouterConfig,
        balancer: Balancer,
        policy: Policy,
        upstream: Pool,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg
        self.balancer = balancer
        self.policy = policy
        self.upstream = upstream
        self.metrics = metrics
        self.rng = rng or random.Random()
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
            decision = await self._decide(parsed, path)
            self.metrics.requests_for(path, decision.route.value, decision.reason).inc()
            async with asyncio.timeout(self.cfg.timeouts.request_s):
                reply = await self._attempts(client, parsed, path, decision.route, start)
            self.metrics.e2e_for(decision.route.value).observe(time.monotonic() - start)
            return reply
        except asyncio.CancelledError:  # the server cancels the handler when the client disconnects
            self.metrics.client_disconnects.inc()
            raise
        except TimeoutError:
            if not client.started:
                raise ApiError(504, "the request timed out") from None
            with contextlib.suppress(_ClientGone):
                await self._write_error(client, "the request timed out", 504)
            return None
        finally:
            self.pending -= 1

    async def _decide(self, parsed: Parsed, path: str) -> Decision:
        """The policy's route; while it says WAIT, wait for a slot in the pool it names (bounded by
        queue_timeout_s, then 429); REJECT is a 503."""
        deadline = time.monotonic() + self.cfg.policy.queue_timeout_s
        retry_after = self.cfg.server.retry_after_s
        self.metrics.queued.inc()
        try:
            while True:
                b = self.balancer
                decision = self.policy.decide(
                    PolicyInput(
                        parsed.prompt_tokens, b.prefill.load(), b.decode.load(), parsed.fan_out is None
                    )
                )
                if decision.route is Route.LOCAL or decision.route is Route.DISAGG:
                    return decision
                role = _POOL_OF[decision.reason]
                if decision.route is Route.REJECT:
                    self.metrics.requests_for(path, "rejected", decision.reason).inc()
                    raise _unavailable(role, retry_after)
                left = deadline - time.monotonic()
                if left <= 0:
                    self.metrics.requests_for(path, "rejected", decision.reason).inc()
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
        self, client: Downstream, parsed: Parsed, path: str, route: Route, start: float
    ) -> Reply | None:
        failed: set[Worker] = set()
        last: UpstreamError | None = None
        missing = "decode"  # which pool ran out of workers, when one did before any attempt
        for attempt in range(self.cfg.retry.max_attempts):
            if attempt:
                self.metrics.retries.labels("decode").inc()
                await asyncio.sleep(self._backoff(attempt - 1))
            decode = self.balancer.pick_decode(self.cfg.policy.decode_max_active, failed)
            if decode is None:
                break
            prefill = self.balancer.pick_prefill(failed) if route is Route.DISAGG else None
            if prefill is None and route is Route.DISAGG and not self.cfg.decode_prefills():
                missing = "prefill"
                break
            try:
                if parsed.stream:
                    return await self._stream(client, parsed, path, decode, prefill, failed, start)
                return await self._unary(parsed, path, decode, prefill, failed)
            except UpstreamError as e:
                if e.client_error:
                    return json_reply(e.status, e.body)
                last = e
                log.warning("attempt %d failed: %s", attempt + 1, e)
        if last is None:
            raise _unavailable(missing, self.cfg.server.retry_after_s)
        if last.status == 429:
            raise overloaded("upstream workers are overloaded", self.cfg.server.retry_after_s)
        log.error("giving up after %d attempts: %s", self.cfg.retry.max_attempts, last)
        what = "timed out" if last.kind == "timeout" else f"failed ({last.kind})"
        raise ApiError(502, f"upstream workers {what} after {self.cfg.retry.max_attempts} attempts")

    # ---- legs ---------------------------------------------------------------------------------------------

    def _fail(self, worker: Worker, e: UpstreamError, failed: set[Worker]) -> None:
        self.metrics.worker_errors.labels(worker.role, worker.url, e.kind).inc()
        if e.worker_fault:
            worker.circuit.record_failure()
            failed.add(worker)

    def _blame(self, e: UpstreamError, decode: Worker, prefill: Worker | None, failed: set[Worker]) -> None:
        """Record a failed attempt against the worker that caused it (its P leg was already counted)."""
        if isinstance(e, _PrefillFailed):
            if prefill is not None:
                failed.add(prefill)
        else:
            self._fail(decode, e, failed)

    async def _legs(
        self,
        path: str,
        body: dict[str, Any],
        raw: bytes | None,
        tokens: int,
        prefill: Worker | None,
        failed: set[Worker],
        extra: dict[str, Any],
    ) -> tuple[bytes, bool, asyncio.Task[bytes] | None]:
        """D's body for ``body`` (plus ``extra`` fields), whether it is the local path, and a concurrent P leg.

        ``raw``: ``body``'s bytes when the client sent exactly these (forwarded as they are on the local
        path); ``tokens``: the prompt length P's lease counts.
        """
        local = raw if raw is not None and not extra else msgspec.json.encode({**body, **extra})
        if prefill is None:
            return local, True, None
        flow = self.cfg.flow
        transfer, room = transfer_id(), bootstrap_room(self.rng)
        p_body = prefill_body(body, flow, transfer, prefill, room)
        if flow == "vllm-standard":
            for candidate in self._prefill_candidates(prefill, failed):
                try:
                    data = await self._post_prefill(candidate, path, p_body, tokens)
                    params = returned_params(data)
                except UpstreamError as e:
                    self._fail(candidate, e, failed)
                    continue
                d_body = decode_body(body, flow, transfer, candidate, room, params)
                return msgspec.json.encode({**d_body, **extra}), False, None
            return local, True, None  # no prefill worker succeeded: D prefills locally
        task = asyncio.create_task(self._post_prefill(prefill, path, p_body, tokens))
        task.add_done_callback(_consume)
        d_body = decode_body(body, flow, transfer, prefill, room)
        return msgspec.json.encode({**d_body, **extra}), False, task

    def _prefill_candidates(self, first: Worker, failed: set[Worker]) -> list[Worker]:
        others = [w for w in self.balancer.prefill.usable() if w is not first and w not in failed]
        return [first, *others[: self.cfg.retry.max_attempts - 1]]

    async def _post_prefill(self, prefill: Worker, path: str, body: bytes, tokens: int) -> bytes:
        with self.balancer.lease(prefill, tokens):
            try:
                data = await post_json(self.upstream, prefill, path, body)
            except UpstreamError as e:
                self.metrics.prefill_failures.labels(self.cfg.flow).inc()
                if e.worker_fault:
                    prefill.circuit.record_failure()
                self.metrics.worker_errors.labels(prefill.role, prefill.url, e.kind).inc()
                raise
        prefill.circuit.record_success()
        return data

    async def _guarded(self, p_task: asyncio.Task[bytes] | None, leg: Awaitable[Any]) -> Any:
        """Await a D leg; in sglang-bootstrap a failed P leg aborts it (SGLang's D cannot prefill alone)."""
        if p_task is None or self.cfg.flow != "sglang-bootstrap":
            return await leg
        d_task = asyncio.ensure_future(leg)
        try:
            await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task.done() and p_task.exception() is not None and not d_task.done():
                d_task.cancel()
                raise _PrefillFailed(
                    "prefill", "prefill leg failed; SGLang decode cannot continue without it"
                )
            return await d_task
        finally:
            if not d_task.done():
                d_task.cancel()

    async def _unary(
        self, parsed: Parsed, path: str, decode: Worker, prefill: Worker | None, failed: set[Worker]
    ) -> Reply:
        body, local, p_task = await self._legs(
            path, parsed.body, parsed.raw, parsed.prompt_tokens, prefill, failed, {}
        )
        try:
            with self.balancer.lease(decode):
                try:
                    data = await self._guarded(p_task, post_json(self.upstream, decode, path, body))
                except UpstreamError as e:
                    self._blame(e, decode, prefill, failed)
                    raise
            decode.circuit.record_success()
            route = "local" if local else "disagg"
            return json_reply(200, data, {ROUTE_HEADER: route})
        finally:
            _cancel(p_task)

    async def _stream(
        self,
        client: Downstream,
        parsed: Parsed,
        path: str,
        decode: Worker,
        prefill: Worker | None,
        failed: set[Worker],
        start: float,
    ) -> Reply | None:
        """First attempt of a streamed request; commits to the client after the first upstream event."""
        strip = _wants_ids(parsed, decode)
        extra = {"return_token_ids": True} if strip else {}
        body, local, p_task = await self._legs(
            path, parsed.body, parsed.raw, parsed.prompt_tokens, prefill, failed, extra
        )
        route = "local" if local else "disagg"
        state = StreamState(need_text=parsed.kind == "chat") if parsed.resumable else None
        try:
            with self.balancer.lease(decode):
                try:
                    resp, first = await self._guarded(p_task, self._first_event(decode, path, body))
                except UpstreamError as e:
                    self._blame(e, decode, prefill, failed)
                    raise
                try:
                    try:
                        await client.start({**_SSE_HEADERS, ROUTE_HEADER: route})
                    except ConnectionError:
                        raise _ClientGone from None
                    self.metrics.ttft_for(route).observe(time.monotonic() - start)
                    err = await self._relay(client, resp, decode, first, state, None, route, strip)
                finally:
                    resp.close()
            if err is None:
                decode.circuit.record_success()
                return None
            self._fail(decode, err, failed)
            await self._resume(client, parsed, path, state, err, failed, route, strip)
            return None
        except _ClientGone:
            self.metrics.client_disconnects.inc()
            return None if client.started else Reply(499)
        finally:
            _cancel(p_task)

    async def _first_event(self, worker: Worker, path: str, body: bytes) -> tuple[Response, bytes]:
        resp: Response | None = None
        try:
            async with asyncio.timeout(self.cfg.timeouts.first_byte_s):
                resp = await open_stream(self.upstream, worker, path, body)
                first = await read_event(resp, worker)
        except TimeoutError:
            if resp is not None:
                resp.close()
            raise UpstreamError("timeout", f"no first token from {worker.url}") from None
        except BaseException:
            if resp is not None:
                resp.close()
            raise
        if not first.endswith(b"\n\n"):
            resp.close()
            raise UpstreamError("protocol", f"{worker.url} closed the stream before the first event")
        return resp, first

    async def _relay(
        self,
        client: Downstream,
        resp: Response,
        worker: Worker,
        first: bytes,
        state: StreamState | None,
        stitcher: Stitcher | None,
        route: str,
        strip: bool,
    ) -> UpstreamError | None:
        """Copy events to the client until [DONE]; returns the upstream error that broke the stream, if any.

        The first event goes out through ``client.write``; the rest are relayed by a
        ``_Pump`` inside the upstream connection's read callback, byte for byte, all complete events of one
        read in one write. This coroutine only waits for the end, an error, the idle timeout or a slow client.
        After ``[DONE]`` the upstream connection is released for reuse; the caller closes it on any other exit.
        """

        def transform(batch: bytes) -> bytes:
            if stitcher is not None:
                return stitcher.rewrite_batch(batch)
            if state is not None:
                state.observe_batch(batch)
            return strip_token_ids(batch) if strip else batch

        out = transform(first)
        if out:
            await self._write(client, out)
        if first.endswith(DONE):
            resp.release()  # keep-alive: the connection serves the next leg
            return None
        transport = client.transport
        if transport is None:
            raise _ClientGone
        pump = _Pump(transport, client.chunked, transform, self.metrics.itl_for(route), resp)
        resp.divert(pump.feed)
        idle = self.cfg.timeouts.idle_s
        try:
            while True:
                if pump.failure is not None:
                    raise pump.failure
                if pump.done:
                    resp.release()
                    return None
                if resp.ended():
                    return UpstreamError("protocol", f"{worker.url} ended the stream without [DONE]")
                if pump.paused:  # the client reads slower than the worker writes
                    if transport.is_closing():
                        raise _ClientGone
                    if transport.get_write_buffer_size() > _LOW_WATER:
                        await asyncio.sleep(_DRAIN_POLL_S)
                        pump.seen = time.monotonic()  # a slow client is not an idle worker
                        continue
                    pump.resume()
                left = idle - (time.monotonic() - pump.seen)
                if left <= 0:
                    return UpstreamError("timeout", f"{worker.url} sent nothing for about {idle}s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(resp.wait(), left)
        except HttpError as e:
            return wrap_error(e, worker)

    async def _resume(
        self,
        client: Downstream,
        parsed: Parsed,
        path: str,
        state: StreamState | None,
        err: UpstreamError,
        failed: set[Worker],
        route: str,
        strip: bool,
    ) -> None:
        """Continue a broken stream on other decode workers; if impossible, end it with an error event.

        The continuation goes to D alone, which prefills the prompt and the delivered tokens itself, or,
        where D cannot prefill (sglang-bootstrap), P->D like a new request.
        """
        for _ in range(self.cfg.retry.max_resumes if state is not None else 0):
            assert state is not None
            body = continuation(parsed, state)
            if body is None or state.finished:
                await self._finish(client, state, parsed)
                return
            decode = self.balancer.pick_decode(self.cfg.policy.decode_max_active, failed)
            if decode is None:
                break
            prefill = None
            if not self.cfg.decode_prefills():  # SGLang's D cannot prefill the continuation itself
                prefill = self.balancer.pick_prefill(failed)
                if prefill is None:
                    break
            self.metrics.resumes.inc()
            log.warning("resuming a broken stream on %s after %d tokens: %s", decode.url, state.tokens, err)
            extra = {"return_token_ids": True} if strip or "return_token_ids" in parsed.body else {}
            stitcher = Stitcher(state, await parsed.exact_prompt_tokens(), strip)
            tokens = parsed.prompt_tokens + state.tokens
            d_body, _, p_task = await self._legs(path, body, None, tokens, prefill, failed, extra)
            try:
                with self.balancer.lease(decode):
                    try:
                        resp, first = await self._guarded(p_task, self._first_event(decode, path, d_body))
                    except UpstreamError as e:
                        self._blame(e, decode, prefill, failed)
                        err = e
                        continue
                    try:
                        result = await self._relay(client, resp, decode, first, state, stitcher, route, strip)
                    finally:
                        resp.close()
            finally:
                _cancel(p_task)
            if result is None:
                decode.circuit.record_success()
                return
            self._fail(decode, result, failed)
            err = result
        await self._write_error(
            client, f"the decode worker failed mid-stream and could not be resumed: {err}"
        )

    async def _finish(self, client: Downstream, state: StreamState, parsed: Parsed) -> None:
        """All tokens were delivered before the worker died: close the stream as vLLM would."""
        opts = parsed.body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            prompt_tokens = await parsed.exact_prompt_tokens()
            usage = {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + state.tokens,
                "completion_tokens": state.tokens,
            }
            obj = "text_completion" if parsed.kind == "completions" else "chat.completion.chunk"
            chunk = {
                "id": state.id,
                "object": obj,
                "created": state.created,
                "model": parsed.body["model"],
                "choices": [],
                "usage": usage,
            }
            await self._write(client, b"data: " + msgspec.json.encode(chunk) + b"\n\n")
        await self._write(client, DONE)

    async def _write_error(self, client: Downstream, message: str, status: int = 502) -> None:
        """An error after the headers went out: an OpenAI error object as the last event, then [DONE]."""
        err = ApiError(status, message)
        await self._write(client, b"data: " + err.body() + b"\n\n")
        await self._write(client, DONE)

    async def _write(self, client: Downstream, data: bytes) -> None:
        try:
            await client.write(data)
        except ConnectionError:
            raise _ClientGone from None


# A client whose socket buffer holds more than this stops the upstream from being read until it is below
# _LOW_WATER again (checked every _DRAIN_POLL_S: only slow clients get there).
_HIGH_WATER = 1 << 16
_LOW_WATER = 1 << 14
_DRAIN_POLL_S = 0.002


class _Pump:
    """Relays a stream's events inside the upstream connection's read callback (``Response.divert``).

    Per event this saves the task switch, the futures and aiohttp's write coroutines of a coroutine relay
    (the relay's CPU per event is what queues other streams' events and new requests on a busy router).
    Writes go straight to the client's transport, framed as the downstream frames its body (HTTP/1.1 chunks
    or, for HTTP/1.0, raw), after the downstream has sent the headers and the first event. Never raises: a
    failure is kept for ``_relay`` to raise.
    """

    def __init__(
        self,
        transport: asyncio.Transport,
        chunked: bool,
        transform: Callable[[bytes], bytes],
        itl: EventSeries,
        resp: Response,
    ) -> None:
        self._transport = transport
        self._chunked = chunked
        self._transform = transform
        self._itl = itl
        self._resp = resp
        self._rest = b""
        self.seen = self._sent = time.monotonic()
        self.done = False
        self.paused = False
        self.failure: BaseException | None = None

    def feed(self, data: bytes) -> None:
        if self.done or self.failure is not None:
            return
        now = self.seen = time.monotonic()
        try:
            rest = self._rest + data if self._rest else data
            cut = rest.rfind(b"\n\n")
            if cut < 0:
                self._rest = rest
                return
            batch, self._rest = rest[: cut + 2], rest[cut + 2 :]
            out = self._transform(batch)
            if out:
                if self._transport.is_closing():
                    raise _ClientGone
                self._transport.write(http_chunk(out) if self._chunked else out)
                self._itl.observe(now - self._sent)
                self._sent = now
            if batch.endswith(DONE):
                self.done = True
                self._resp.wake()
            elif not self.paused and self._transport.get_write_buffer_size() > _HIGH_WATER:
                self.paused = True
                self._resp.pause_reading(True)
                self._resp.wake()
        except BaseException as e:  # kept for _relay, which raises it in the handler's task
            self.failure = e
            self._resp.wake()

    def resume(self) -> None:
        self.paused = False
        self._resp.pause_reading(False)


#: The pool a WAIT or REJECT decision is about, by its reason.
_POOL_OF = {
    "no_decode": "decode",
    "decode_saturated": "decode",
    "no_prefill": "prefill",
    "prefill_saturated": "prefill",
}


def _unavailable(role: str, retry_after_s: int) -> ApiError:
    return ApiError(503, f"no healthy {role} worker is available", retry_after_s=retry_after_s)


def _wants_ids(parsed: Parsed, decode: Worker) -> bool:
    """Ask a vLLM decode worker for token ids (and hide them again) so a resume is token-exact."""
    return parsed.resumable and decode.cfg.engine == "vllm" and "return_token_ids" not in parsed.body


def _consume(task: asyncio.Task[bytes]) -> None:
    """Retrieve a P leg's exception so asyncio does not log it as unhandled (it is already counted)."""
    if not task.cancelled():
        task.exception()


def _cancel(task: asyncio.Task[bytes] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
